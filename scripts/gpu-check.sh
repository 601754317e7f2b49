#!/usr/bin/env bash
# Every GPU test and the overlap demo, in one command, on any machine with an NVIDIA GPU,
# its driver and NVRTC (libnvrtc.so, from the CUDA toolkit). Prints the figures the GPU
# issue asks for: staging GB/s, layerwise vs whole batch against the ideal, bytes verified.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${GPU_CHECK_OUT:-gpu-check-out}
mkdir -p "$out"
echo "== GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi not found"
ls /usr/lib/x86_64-linux-gnu/libnvrtc* /usr/local/cuda*/lib64/libnvrtc* 2>/dev/null | head -3 || true
echo "== gpu feature tests (probe, device regions, events, the layer waiter, the timeline)"
cargo test -p kvferry-gpu --features gpu -- --nocapture || exit 1
echo "== the GPU overlap demo as a test (skips with its reason where no GPU is usable)"
cargo test -p kvferry-testkit --features gpu --test gpu_demo -- --nocapture || exit 1
echo "== CLI: demo --gpu, compute-bound (20 ms per layer) and transfer-bound (2 ms per layer)"
cargo build --release -p kvferry-cli --features gpu || exit 1
rc=0
./target/release/kvferry demo --gpu --batch 16 --layers 16 --layer-compute-us 20000 \
    --timeline "$out/gpu-timeline-20ms.svg" || rc=1
./target/release/kvferry demo --gpu --batch 16 --layers 16 --layer-compute-us 20000 --json \
    > "$out/gpu-20ms.json" || rc=1
./target/release/kvferry demo --gpu --batch 16 --layers 16 --layer-compute-us 2000 \
    --timeline "$out/gpu-timeline-2ms.svg" || rc=1
./target/release/kvferry demo --gpu --batch 16 --layers 16 --layer-compute-us 20000 \
    --runtime glommio || rc=1
echo "gpu-check: rc=$rc (timelines and JSON in $out/)"
exit $rc
