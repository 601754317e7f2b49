#!/usr/bin/env bash
# One room at a time over a link that delays, jitters and reorders packets: a prefill in one
# network namespace, a decode in another, joined by a veth pair whose both ends run
# `tc qdisc ... netem $NETEM`. Prints the kvferry room latency (p50) against one plain TCP
# stream moving the same bytes over the same link, and their ratio. Needs root, ip netns and
# the kernel's sch_netem (refused with a clear message where it is missing).
#
#   scripts/reorder-figures.sh                         (NETEM="delay 5ms 2ms reorder 25%")
#   NETEM="delay 5ms" scripts/reorder-figures.sh       (delay alone, for the baseline ratio)
#   NETEM= scripts/reorder-figures.sh                  (a plain veth)
#
# Room shape: PAGES pages (256) of PB bytes (16 KiB) in each of 8 layers x K/V, ROOMS rooms
# (20); the CLI prefill writes its byte pattern into each room's pages before sending, which
# the kvferry figure includes and the plain stream does not.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${KVFERRY_BIN:-target/release/kvferry}
NETEM=${NETEM-delay 5ms 2ms reorder 25%}
PAGES=${PAGES:-256}
PB=${PB:-16384}
ROOMS=${ROOMS:-20}
P=kvf-ro-p
D=kvf-ro-d
BYTES=$((PAGES * PB * 16))
WORK=$(mktemp -d)
PIDS=()
cleanup_ns() {
    ip netns del "$P" 2>/dev/null || true
    ip netns del "$D" 2>/dev/null || true
}
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    cleanup_ns
    rm -rf "$WORK"
}
trap cleanup EXIT
cleanup_ns
[ -x "$BIN" ] || cargo build --release -p kvferry-cli --bin kvferry
ip netns add "$P"
ip netns add "$D"
ip link add kvf-ro0 type veth peer name kvf-ro1
ip link set kvf-ro0 netns "$P"
ip link set kvf-ro1 netns "$D"
ip -n "$P" addr add 10.78.0.1/24 dev kvf-ro0
ip -n "$D" addr add 10.78.0.2/24 dev kvf-ro1
for ns in "$P" "$D"; do ip -n "$ns" link set lo up; done
ip -n "$P" link set kvf-ro0 up
ip -n "$D" link set kvf-ro1 up
if [ -n "$NETEM" ]; then
    # shellcheck disable=SC2086 # the netem options are words
    if ! ip netns exec "$P" tc qdisc add dev kvf-ro0 root netem $NETEM 2>"$WORK/tc.err"; then
        echo "reorder-figures: cannot add 'netem $NETEM': $(cat "$WORK/tc.err") (this kernel needs sch_netem)" >&2
        exit 2
    fi
    # shellcheck disable=SC2086
    ip netns exec "$D" tc qdisc add dev kvf-ro1 root netem $NETEM
fi
ip netns exec "$P" "$BIN" prefill --listen 10.78.0.1:7511 --pages-per-room "$PAGES" \
    --page-bytes "$PB" >"$WORK/prefill.log" 2>&1 &
PIDS+=($!)
ip netns exec "$D" python3 scripts/tcp-blast.py serve 7512 "$BYTES" >/dev/null 2>&1 &
PIDS+=($!)
sleep 0.5
room=$(ip netns exec "$D" "$BIN" decode --connect 10.78.0.1:7511 --rooms "$ROOMS" \
    --concurrency 1 --pages-per-room "$PAGES" --page-bytes "$PB" --json 2>/dev/null |
    python3 -c 'import json,sys; r=json.load(sys.stdin); assert r["pages_corrupted"] == 0, r; print(r["latency_ms"]["p50"])')
plain=$(ip netns exec "$P" python3 scripts/tcp-blast.py send 10.78.0.2 7512 "$BYTES" "$ROOMS" |
    awk '{print $3}')
python3 -c "print('netem: ${NETEM:-none}; room of $BYTES bytes: kvferry p50 %.0f ms, one TCP stream p50 %.0f ms, ratio %.2f' % ($room, $plain, $room / $plain))"
