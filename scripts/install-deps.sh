#!/usr/bin/env bash
# Installs the system packages the project's optional features need (idempotent).
#   rdma: libibverbs (rdma-sys links it), librdmacm, and libclang for rdma-sys's bindgen.
#   link faults: nftables and iproute2 (the network-namespace outage test drops packets).
set -euo pipefail
need=()
for pkg in libibverbs-dev librdmacm-dev libclang-dev ibverbs-providers nftables iproute2; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -eq 0 ]; then
    echo "system packages: all present"
    exit 0
fi
echo "installing: ${need[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
echo "installed: ${need[*]}"
