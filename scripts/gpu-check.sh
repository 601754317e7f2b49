#!/usr/bin/env bash
# Every GPU test, in one command, on any machine with an NVIDIA GPU and driver.
set -uo pipefail
cd "$(dirname "$0")/.."
echo "== GPU"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi not found"
echo "== gpu feature tests (probe, device regions, events, the layer waiter, the timeline)"
cargo test -p kvferry-gpu --features gpu -- --nocapture || exit 1
echo "== CLI: the GPU demo"
cargo build --release -p kvferry-cli --features gpu || exit 1
./target/release/kvferry demo --gpu --layerwise --rooms 16 --timeline gpu-timeline.svg
echo "demo --gpu: rc=$?"
