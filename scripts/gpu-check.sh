#!/usr/bin/env bash
# The GPU check, in two halves, because the GPU machines have the NVIDIA driver, CUDA and
# PyTorch but no Rust and no registry:
#
#   scripts/gpu-check.sh --bundle DIR   # here: builds every binary the check runs into DIR
#                                       # (release, stripped; fails if DIR passes 64 MiB)
#   scripts/gpu-check.sh --run DIR      # there: runs it, figures as JSON lines in $OUT
#                                       # (or DIR/out), exits non-zero on any failure
#
# What --run checks: the gpu crate's tests on the GPU (probe, device regions, events, the
# layer waiter, the CUDA copy engine staging device pages both ways, pointer kinds), the
# layerwise overlap demo with real kernels against the ideal, and device-to-device rooms
# between two nodes over loopback TCP (tokio and glommio), every byte verified.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: $0 --bundle DIR | --run DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
mode=$1
dir=$2

bundle() {
    set -e
    rm -rf "$dir"
    mkdir -p "$dir/bin"
    local json
    json=$(mktemp)
    # Test binaries, as cargo reports them (release: a tenth of the debug size).
    cargo test --release --no-run --message-format=json \
        -p kvferry-gpu --features gpu >"$json"
    cargo test --release --no-run --message-format=json \
        -p kvferry-testkit --features gpu --test gpu_demo >>"$json"
    cargo test --release --no-run --message-format=json \
        -p kvferry-tests --features gpu --test device_gpu >>"$json"
    python3 - "$json" "$dir/bin" <<'EOF'
import json, shutil, sys
seen = set()
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable")
    if m.get("reason") == "compiler-artifact" and exe and m["profile"]["test"] and exe not in seen:
        seen.add(exe)
        shutil.copy(exe, sys.argv[2])
EOF
    rm -f "$json"
    cargo build --release -p kvferry-cli --features gpu
    cp target/release/kvferry "$dir/bin/kvferry"
    # The abi3 wheel (CUDA copy engine inside, loaded at run time) and its GPU test.
    local py=${KVFERRY_CACHE:-$HOME/.cache/kvferry}/py
    [ -x "$py/bin/python" ] || python3 -m venv "$py"
    CARGO_TARGET_DIR="$PWD/target/python" "$py/bin/pip" wheel -q --no-deps ./python -w "$dir/wheel"
    cp python/tests/test_gpu_rooms.py "$dir/"
    strip "$dir"/bin/* 2>/dev/null || true
    set +e
    cp "$0" "$dir/gpu-check.sh"
    local size
    size=$(du -sm "$dir" | cut -f1)
    echo "bundle: $(ls "$dir/bin" | wc -l) binaries, ${size} MiB in $dir"
    ls -la "$dir/bin"
    if [ "$size" -gt 64 ]; then
        echo "the bundle is ${size} MiB, over the 64 MiB a device call carries" >&2
        exit 1
    fi
}

run() {
    local out=${OUT:-$dir/out}
    mkdir -p "$out"
    local rc=0
    echo "== GPU"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi not found"
    echo "== test binaries (each skips with its reason where no GPU is usable)"
    for t in "$dir"/bin/*; do
        case "$(basename "$t")" in kvferry) continue ;; esac
        echo "-- $(basename "$t")"
        "$t" --nocapture --test-threads 1 2>&1 | tee -a "$out/tests.log" || rc=1
    done
    grep -h '^{"check"' "$out/tests.log" >"$out/figures.jsonl" 2>/dev/null || true
    echo "== the wheel over torch CUDA tensors, prefill and decode processes"
    local site="$out/site"
    if python3 -m pip install -q --no-deps --target "$site" "$dir"/wheel/*.whl; then
        PYTHONPATH="$site" python3 "$dir/test_gpu_rooms.py" 2>&1 | tee "$out/python.log" || rc=1
        grep -h '^{"check"' "$out/python.log" >>"$out/figures.jsonl" 2>/dev/null || true
    else
        echo "cannot install the wheel" >&2
        rc=1
    fi
    echo "== CLI: demo --gpu, compute-bound (20 ms per layer) and transfer-bound (2 ms per layer)"
    local k="$dir/bin/kvferry"
    "$k" demo --gpu --batch 16 --layers 16 --layer-compute-us 20000 \
        --timeline "$out/gpu-timeline-20ms.svg" || rc=1
    "$k" demo --gpu --batch 16 --layers 16 --layer-compute-us 20000 --json \
        >"$out/gpu-20ms.json" || rc=1
    "$k" demo --gpu --batch 16 --layers 16 --layer-compute-us 2000 --json \
        >"$out/gpu-2ms.json" || rc=1
    "$k" demo --gpu --batch 16 --layers 16 --layer-compute-us 20000 --runtime glommio || rc=1
    echo "gpu-check: rc=$rc (figures, timelines and logs in $out/)"
    return $rc
}

case "$mode" in
    --bundle) bundle ;;
    --run) run ;;
    *) usage ;;
esac
