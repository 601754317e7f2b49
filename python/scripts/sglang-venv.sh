#!/usr/bin/env bash
# Creates (once) a venv with the pinned SGLang, what its servers import to start, and the
# pinned sglang-router, outside the clone: ~6 GB, torch included. Prints the venv's python on
# stdout. kvferry itself goes in with `pip install ./python` (python/README).
# SGLang's own dependency list pulls CUDA kernels (sgl-kernel, flashinfer) that do not install
# on a CPU machine, so SGLang goes in with --no-deps and its import-time needs are listed here.
set -euo pipefail
SGLANG_VERSION=0.5.23
venv=${KVFERRY_CACHE:-$HOME/.cache/kvferry}/sglang-$SGLANG_VERSION
stamp="$venv/.kvferry-complete-3"
if [ ! -f "$stamp" ]; then
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv" >&2
    pip="$venv/bin/pip"
    "$pip" install -q --upgrade pip >&2
    "$pip" install -q --no-deps "sglang==$SGLANG_VERSION" >&2
    # The versions SGLang 0.5.23 pins itself, where it pins them.
    "$pip" install -q numpy pyzmq aiohttp msgspec requests torch==2.14.1 orjson psutil pybase64 \
        packaging pillow starlette pydantic tqdm IPython transformers==5.19.0 tokenizers==0.23.2 \
        fastapi uvicorn dill apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 \
        compressed-tensors==0.18.0 gguf pytest maturin >&2
    "$pip" install -q --no-deps torchvision >&2
    # What the servers import at start, and the router, pinned to the versions tested.
    "$pip" install -q uvloop==0.23.0 openai==2.8.0 partial-json-parser==0.2.1.1.post7 \
        setproctitle==1.3.8 einops==0.8.2 jsonschema==4.26.0 xgrammar==0.2.7 soundfile==0.13.1 \
        python-multipart==0.0.34 sglang-router==0.3.2 >&2
    "$venv/bin/python" -c 'import sglang.srt.disaggregation.common.conn, uvloop, openai, sglang_router' >&2
    touch "$stamp"
fi
echo "$venv/bin/python"
