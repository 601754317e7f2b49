#!/usr/bin/env bash
# One room at a time over a link that delays, jitters and reorders packets: a prefill in one
# network namespace, a decode in another. Prints the kvferry room latency (p50) against one
# plain TCP stream moving the same bytes over the same link, and their ratio. Needs root and
# ip netns.
#
# The link is a veth pair whose both ends run `tc qdisc ... netem $NETEM` where the kernel has
# sch_netem; elsewhere (or with LINK=tun) two TUN devices joined by scripts/netem-tun.py, which
# applies the same delay, jitter and reordering in user space to each packet the kernel hands
# it, which (with segmentation offload, MTU $TUN_MTU) are the same up-to-64 KiB GSO packets
# netem handles on a veth.
#
#   scripts/reorder-figures.sh                         (NETEM="delay 5ms 2ms reorder 25%")
#   NETEM="delay 5ms" scripts/reorder-figures.sh       (delay alone, for the baseline ratio)
#   NETEM= scripts/reorder-figures.sh                  (a plain link)
#   LINK=tun scripts/reorder-figures.sh                (the user-space link even with netem)
#
# Room shape: PAGES pages (256) of PB bytes (16 KiB) in each of 8 layers x K/V, ROOMS rooms
# (20); the CLI prefill writes its byte pattern into each room's pages before sending, which
# the kvferry figure includes and the plain stream does not. DATA_CONNECTIONS (2, the decode's
# default) sets the decode's data connections per session.
set -euo pipefail
# The nodes listen on a veth address, beyond loopback: they need a cluster token of their own.
export KVFERRY_TOKEN=${KVFERRY_TOKEN:-netns-check}
cd "$(dirname "$0")/.."
BIN=${KVFERRY_BIN:-target/release/kvferry}
NETEM=${NETEM-delay 5ms 2ms reorder 25%}
PAGES=${PAGES:-256}
PB=${PB:-16384}
ROOMS=${ROOMS:-20}
LINK=${LINK:-auto}
DATA_CONNECTIONS=${DATA_CONNECTIONS:-2}
TUN_MTU=${TUN_MTU:-1500}
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
netem_args() {
    # "delay 5ms 2ms reorder 25%" -> "5 2 25" for scripts/netem-tun.py
    local delay=0 jitter=0 reorder=0
    if [[ $NETEM =~ delay\ ([0-9.]+)ms(\ ([0-9.]+)ms)? ]]; then
        delay=${BASH_REMATCH[1]}
        jitter=${BASH_REMATCH[3]:-0}
    fi
    [[ $NETEM =~ reorder\ ([0-9.]+)% ]] && reorder=${BASH_REMATCH[1]}
    echo "$delay $jitter $reorder"
}
veth_link() {
    ip link add kvf-ro0 type veth peer name kvf-ro1
    ip link set kvf-ro0 netns "$P"
    ip link set kvf-ro1 netns "$D"
    if [ -n "$NETEM" ]; then
        # shellcheck disable=SC2086 # the netem options are words
        ip netns exec "$P" tc qdisc add dev kvf-ro0 root netem $NETEM 2>"$WORK/tc.err" || return 1
        # shellcheck disable=SC2086
        ip netns exec "$D" tc qdisc add dev kvf-ro1 root netem $NETEM
    fi
}
tun_link() {
    ip link del kvf-ro0 2>/dev/null || true
    # shellcheck disable=SC2046 # three numbers
    python3 scripts/netem-tun.py kvf-ro0 kvf-ro1 $(netem_args) >"$WORK/tun.out" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 100); do grep -q ready "$WORK/tun.out" && break; sleep 0.05; done
    grep -q ready "$WORK/tun.out" || { cat "$WORK/tun.out" >&2; exit 2; }
    ip link set kvf-ro0 netns "$P"
    ip link set kvf-ro1 netns "$D"
    ip -n "$P" link set kvf-ro0 mtu "$TUN_MTU"
    ip -n "$D" link set kvf-ro1 mtu "$TUN_MTU"
}
case "$LINK" in
    netem) veth_link || { echo "reorder-figures: cannot add 'netem $NETEM': $(cat "$WORK/tc.err")" >&2; exit 2; } ;;
    tun) tun_link ;;
    auto)
        if ! veth_link; then
            echo "reorder-figures: no sch_netem here ($(cat "$WORK/tc.err")); using the TUN link" >&2
            cleanup_ns
            ip netns add "$P"
            ip netns add "$D"
            LINK=tun
            tun_link
        else
            LINK=netem
        fi
        ;;
    *) echo "reorder-figures: LINK is netem, tun or auto, not '$LINK'" >&2; exit 2 ;;
esac
ip -n "$P" addr add 10.78.0.1/24 dev kvf-ro0
ip -n "$D" addr add 10.78.0.2/24 dev kvf-ro1
for ns in "$P" "$D"; do ip -n "$ns" link set lo up; done
ip -n "$P" link set kvf-ro0 up
ip -n "$D" link set kvf-ro1 up
ip netns exec "$P" "$BIN" prefill --listen 10.78.0.1:7511 --pages-per-room "$PAGES" \
    --page-bytes "$PB" >"$WORK/prefill.log" 2>&1 &
PIDS+=($!)
ip netns exec "$D" python3 scripts/tcp-blast.py serve 7512 "$BYTES" >/dev/null 2>&1 &
PIDS+=($!)
sleep 0.5
ip netns exec "$D" "$BIN" decode --connect 10.78.0.1:7511 --rooms "$ROOMS" \
    --concurrency 1 --data-connections "$DATA_CONNECTIONS" --pages-per-room "$PAGES" --page-bytes "$PB" --json \
    >"$WORK/decode.json" 2>"$WORK/decode.log" || true
if ! room=$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); assert r["pages_corrupted"] == 0 and r["rooms_succeeded"] == int(sys.argv[2]), r; print(r["latency_ms"]["p50"])' \
    "$WORK/decode.json" "$ROOMS"); then
    echo "reorder-figures: the decode did not move every room clean; its report and its log's end:" >&2
    cat "$WORK/decode.json" >&2
    tail -n 20 "$WORK/decode.log" "$WORK/prefill.log" >&2
    exit 1
fi
plain=$(ip netns exec "$P" python3 scripts/tcp-blast.py send 10.78.0.2 7512 "$BYTES" "$ROOMS" |
    awk '{print $3}')
warm=$(ip netns exec "$P" python3 scripts/tcp-blast.py send-warm 10.78.0.2 7512 "$BYTES" "$ROOMS" |
    awk '{print $3}')
python3 - "$LINK" "${NETEM:-none}" "$BYTES" "$room" "$plain" "$warm" <<'PY'
import sys
link, netem, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
room, plain, warm = (float(v) for v in sys.argv[4:7])
print(f"link: {link}, netem: {netem}; room of {nbytes} bytes: kvferry p50 {room:.0f} ms; "
      f"one TCP stream p50 {plain:.0f} ms fresh (ratio {room / plain:.2f}), "
      f"{warm:.0f} ms kept open (ratio {room / warm:.2f})")
PY
