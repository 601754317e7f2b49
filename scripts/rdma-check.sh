#!/usr/bin/env bash
# Every RDMA test and bench, in one command, on a machine that has (or can get) an RDMA device.
#   scripts/rdma-check.sh            # use what /sys/class/infiniband has
#   RXE_NETDEV=eth0 scripts/rdma-check.sh   # first try soft-RoCE on eth0 (needs root)
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
echo "== devices"
ls /sys/class/infiniband 2>&1
if [ -n "${RXE_NETDEV:-}" ] && [ -z "$(ls /sys/class/infiniband 2>/dev/null)" ]; then
    echo "== soft-RoCE on $RXE_NETDEV"
    modprobe rdma_rxe 2>&1; echo "modprobe rdma_rxe: rc=$?"
    rdma link add rxe0 type rxe netdev "$RXE_NETDEV" 2>&1; echo "rdma link add: rc=$?"
    ls /sys/class/infiniband 2>&1
fi
echo "== rdma feature tests (completion table, QP lifecycle, handshake, device discovery, verbs)"
cargo test -p kvferry-rdma --features rdma -- --nocapture || exit 1
echo "== rooms end to end over RDMA (tokio driver): many rooms, aborts and the fence, layerwise"
cargo test -p kvferry-tests --release --features rdma --test rdma -- --nocapture || exit 1
echo "== CLI with RDMA"
cargo build --release -p kvferry-cli --features rdma || exit 1
rc=0
./target/release/kvferry demo --backend rdma || rc=1
echo "demo --backend rdma: rc=$rc"
./target/release/kvferry demo --backend rdma --abort-rate 0.1 --rooms 2000 --concurrency 64 || rc=1
./target/release/kvferry demo --overlap --backend rdma || rc=1
./target/release/kvferry bench --backend rdma --iterations 3 || rc=1
echo "rdma-check: rc=$rc"
exit $rc
