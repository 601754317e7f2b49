#!/usr/bin/env bash
# The GPU check, in two halves, because the GPU machines have the NVIDIA driver, CUDA and
# PyTorch but no Rust and no registry:
#
#   scripts/gpu-check.sh --bundle DIR   # here: builds every binary the check runs into DIR
#                                       # (release, stripped; fails if DIR passes 64 MiB;
#                                       # KVFERRY_BUNDLE_PROFILE=dev: CI's quicker build)
#   scripts/gpu-check.sh --run DIR      # there: runs it, figures as JSON lines in $OUT
#                                       # (or DIR/out), exits non-zero on any failure
#   scripts/gpu-check.sh --selftest     # here (CI): the rules of --run on a fake bundle
#   scripts/gpu-check.sh --summary OUT  # the figures of a run in OUT against their targets
#
# --run gives each step its own time limit and the whole run GPU_CHECK_BUDGET_S (480 s), so
# a lent machine's 15 minutes allow a rerun; where nvidia-smi lists a GPU, a test that prints
# SKIPPED fails the run (it tested nothing).
#
# What --run checks: the gpu crate's tests on the GPU (probe, device regions, events, the
# layer waiter, the CUDA copy engine staging device pages both ways, pointer kinds, the
# caller's context kept, CUDA IPC copies into another process's memory checked there), the
# layerwise overlap demo with real kernels against the ideal,
# device-to-device rooms between two nodes over loopback TCP (tokio and glommio) against the
# same run's host-to-host rooms, every byte verified, a fault run on the CUDA engine (rooms
# aborted mid-copy, a prefill gone with copies in flight: nothing held after), and the copy
# engine's batches against one 64 MiB copy. It ends with one line per figure, its ratio and
# its target, and fails where a target is missed or, with a GPU, a figure is missing.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: $0 --bundle DIR | --run DIR | --summary OUT | --selftest" >&2; exit 2; }
mode=${1:-}
[ $# -eq 2 ] || [ "$mode" = --selftest ] || usage
dir=${2:-}

bundle() {
    set -e
    rm -rf "$dir"
    mkdir -p "$dir/bin"
    local json
    json=$(mktemp)
    # The profile a GPU machine runs is release (figures against targets); CI checks that the
    # bundle builds and fits with the dev profile, whose dependencies its earlier stages built.
    local profile=${KVFERRY_BUNDLE_PROFILE:-release} out
    out=$([ "$profile" = dev ] && echo debug || echo "$profile")
    # Test binaries, as cargo reports them.
    cargo test --profile "$profile" --no-run --message-format=json \
        -p kvferry-gpu --features gpu >"$json"
    cargo test --profile "$profile" --no-run --message-format=json \
        -p kvferry-testkit --features gpu --test gpu_demo >>"$json"
    cargo test --profile "$profile" --no-run --message-format=json \
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
    cargo build --profile "$profile" -p kvferry-cli --features gpu
    cp "target/$out/kvferry" "$dir/bin/kvferry"
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

# The whole run stays within this many seconds (a lent machine's 15 minutes then allow a
# rerun); each step also has its own limit.
budget_s=${GPU_CHECK_BUDGET_S:-480}

run() {
    local out=${OUT:-$dir/out}
    mkdir -p "$out"
    local rc=0 gpu=0
    echo "== GPU"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi not found"
    # Where the driver lists a GPU, a test that skips for want of one tests nothing: a failure.
    nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && gpu=1
    # Runs a step under the lesser of its own limit and what is left of the budget; its
    # output goes to the terminal and to LOG. Fails the run on a non-zero exit, on a timeout,
    # and on a SKIPPED line where a GPU is present.
    step() {
        local limit=$1 log=$2
        shift 2
        local left=$((budget_s - SECONDS))
        if [ "$left" -le 5 ]; then
            echo "gpu-check: no time left for: $*" >&2
            rc=1
            return
        fi
        [ "$limit" -gt "$left" ] && limit=$left
        local before=0
        [ -f "$log" ] && before=$(wc -l <"$log")
        timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$log"
        local code=${PIPESTATUS[0]}
        if [ "$code" -ne 0 ]; then
            echo "gpu-check: FAILED (exit $code$([ "$code" -ge 124 ] && echo ", over ${limit} s")): $*" >&2
            rc=1
        elif [ "$gpu" -eq 1 ] && tail -n +"$((before + 1))" "$log" | grep -q SKIPPED; then
            echo "gpu-check: FAILED (a GPU is present, yet it skipped): $*" >&2
            rc=1
        fi
    }
    echo "== test binaries (each skips with its reason where no GPU is usable)"
    for t in "$dir"/bin/*; do
        case "$(basename "$t")" in kvferry) continue ;; esac
        echo "-- $(basename "$t")"
        step 120 "$out/tests.log" "$t" --nocapture --test-threads 1
    done
    grep -h '^{"check"' "$out/tests.log" >"$out/figures.jsonl" 2>/dev/null || true
    echo "== the wheel over torch CUDA tensors, prefill and decode processes"
    local site="$out/site"
    if python3 -m pip install -q --no-deps --target "$site" "$dir"/wheel/*.whl; then
        step 180 "$out/python.log" env PYTHONPATH="$site" python3 "$dir/test_gpu_rooms.py"
        grep -h '^{"check"' "$out/python.log" >>"$out/figures.jsonl" 2>/dev/null || true
    else
        echo "cannot install the wheel" >&2
        rc=1
    fi
    echo "== CLI: demo --gpu, compute-bound (20 ms per layer) and transfer-bound (2 ms per layer)"
    local k="$dir/bin/kvferry"
    step 90 "$out/demo.log" "$k" demo --gpu --batch 16 --layers 16 --layer-compute-us 20000 \
        --timeline "$out/gpu-timeline-20ms.svg"
    # The JSON reports go to their own files; their logs to demo.log.
    step 90 "$out/demo.log" bash -c 'exec "$@" >"$0"' "$out/gpu-20ms.json" \
        "$k" demo --gpu --batch 16 --layers 16 --layer-compute-us 20000 --json
    step 90 "$out/demo.log" bash -c 'exec "$@" >"$0"' "$out/gpu-2ms.json" \
        "$k" demo --gpu --batch 16 --layers 16 --layer-compute-us 2000 --json
    step 90 "$out/demo.log" "$k" demo --gpu --batch 16 --layers 16 --layer-compute-us 20000 --runtime glommio
    echo "== the CUDA copy engine: staged batches against one 64 MiB copy"
    step 120 "$out/bench.log" bash -c 'exec "$@" >"$0"' "$out/copy-engine.jsonl" \
        "$k" bench --copy-engine --gpu --json
    cat "$out/copy-engine.jsonl" >>"$out/figures.jsonl" 2>/dev/null || true
    echo "== figures against their targets"
    GPU_PRESENT=$gpu summary "$out" || rc=1
    echo "gpu-check: rc=$rc in ${SECONDS} s of ${budget_s} (figures, timelines and logs in $out/)"
    return $rc
}

# One line per figure of the run in $1 with its ratio and target; non-zero where a target is
# missed, or where GPU_PRESENT=1 and a figure is missing.
summary() {
    python3 - "$1" "${GPU_PRESENT:-0}" <<'EOF'
import json, os, sys
out, gpu = sys.argv[1], sys.argv[2] == "1"
figures = []
try:
    figures = [json.loads(l) for l in open(os.path.join(out, "figures.jsonl")) if l.startswith("{")]
except OSError:
    pass
seen = {}
for f in figures:
    if f.get("check") == "copy_engine" and f.get("engine") == "cuda":
        seen[f"copy engine {f['workload']} {f['direction']} vs one 64 MiB copy"] = (f["ratio"], ">=", f["target"])
    elif f.get("check") == "device_rooms" and "ratio" in f:
        seen[f"device rooms vs host rooms, {f['runtime']}"] = (f["ratio"], ">=", f["target"])
    elif f.get("check") == "cuda_ipc" and f.get("target") is not None:
        seen[f"CUDA IPC {f['workload']} vs cuMemcpyDtoD in one process"] = (f["ratio"], ">=", f["target"])
    elif f.get("check") == "ipc_rooms" and "ratio" in f:
        seen[f"same-host CUDA IPC rooms vs staged TCP rooms, {f['runtime']}"] = (f["ratio"], ">=", f["target"])
try:
    demo = json.load(open(os.path.join(out, "gpu-20ms.json")))
    for run in demo.get("runs", []):
        if run.get("mode") == "layerwise":
            seen["layerwise complete vs ideal, 20 ms a layer"] = (run["vs_ideal"], "<=", 1.25)
except (OSError, ValueError):
    pass
expected = [f"copy engine {w} {d} vs one 64 MiB copy" for w in ("contiguous", "pages_4k", "rows_256b") for d in ("d2h", "h2d")]
expected += [f"device rooms vs host rooms, {r}" for r in ("tokio", "glommio")]
expected += ["layerwise complete vs ideal, 20 ms a layer"]
expected += ["CUDA IPC contiguous_64MiB vs cuMemcpyDtoD in one process"]
expected += ["same-host CUDA IPC rooms vs staged TCP rooms, tokio"]
failed = 0
for name in expected + sorted(set(seen) - set(expected)):
    if name not in seen:
        print(f"figure {name:<52} {'missing':>8}   {'FAIL' if gpu else 'n/a (no GPU)'}")
        failed += gpu
        continue
    value, op, target = seen[name]
    ok = value >= target if op == ">=" else value <= target
    print(f"figure {name:<52} {value:>8.3f}   target {op} {target:.2f}   {'ok' if ok else 'MISSED'}")
    failed += not ok
sys.exit(1 if failed else 0)
EOF
}

# The check's own rules, on a fake bundle and a fake nvidia-smi (CI has no GPU): a test that
# skips fails the run only where a GPU is listed, and a step past its limit fails it.
selftest() {
    set -e
    local fake
    fake=$(mktemp -d)
    mkdir -p "$fake/bundle/bin" "$fake/bundle/wheel" "$fake/path"
    printf '#!/bin/sh\necho "SKIPPED: no usable GPU here"\n' >"$fake/bundle/bin/skips"
    printf '#!/bin/sh\nsleep 30\n' >"$fake/bundle/bin/zz-hangs"
    printf '#!/bin/sh\necho "{}"\n' >"$fake/bundle/bin/kvferry"
    printf '#!/bin/sh\n[ "$1" = -L ] && echo "GPU 0: Fake (UUID: GPU-0)"\nexit 0\n' >"$fake/path/nvidia-smi"
    chmod +x "$fake"/bundle/bin/* "$fake/path/nvidia-smi"
    set +e
    local with without
    with=$(PATH="$fake/path:$PATH" GPU_CHECK_BUDGET_S=15 OUT="$fake/a" "$0" --run "$fake/bundle" 2>&1)
    without=$(PATH="$fake/path-none:$PATH" GPU_CHECK_BUDGET_S=15 OUT="$fake/b" "$0" --run "$fake/bundle" 2>&1)
    rm -rf "$fake"
    local ok=1
    grep -q "a GPU is present, yet it skipped.*skips" <<<"$with" || { echo "selftest: a skip with a GPU listed passed" >&2; ok=0; }
    grep -q "yet it skipped" <<<"$without" && { echo "selftest: a skip without a GPU failed" >&2; ok=0; }
    grep -q "FAILED (exit 124, over .*zz-hangs" <<<"$with" || { echo "selftest: a step past its limit passed" >&2; ok=0; }
    grep -q "no time left for" <<<"$with" || { echo "selftest: the budget was not kept" >&2; ok=0; }
    # The summary: a missed target fails, a missing figure fails only with a GPU.
    local figs
    figs=$(mktemp -d)
    echo '{"check":"copy_engine","engine":"cuda","workload":"pages_4k","direction":"d2h","ratio":0.31,"target":0.8}' >"$figs/figures.jsonl"
    GPU_PRESENT=0 summary "$figs" >"$figs/missed.txt" && { echo "selftest: a missed target passed" >&2; ok=0; }
    grep -q "pages_4k d2h.*0.310.*MISSED" "$figs/missed.txt" || { echo "selftest: the missed figure was not named" >&2; ok=0; }
    echo '{"check":"copy_engine","engine":"cuda","workload":"pages_4k","direction":"d2h","ratio":0.91,"target":0.8}' >"$figs/figures.jsonl"
    GPU_PRESENT=0 summary "$figs" >/dev/null || { echo "selftest: figures on target failed without a GPU" >&2; ok=0; }
    GPU_PRESENT=1 summary "$figs" >/dev/null && { echo "selftest: missing figures passed with a GPU" >&2; ok=0; }
    rm -rf "$figs"
    [ "$ok" -eq 1 ] && echo "gpu-check selftest: ok"
    [ "$ok" -eq 1 ]
}

case "$mode" in
    --bundle) bundle ;;
    --run) run ;;
    --selftest) selftest ;;
    --summary) summary "$dir" ;;
    *) usage ;;
esac
