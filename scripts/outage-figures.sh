#!/usr/bin/env bash
# Real link faults between two network namespaces joined by a veth pair: a prefill in one, a
# decode in the other, every packet dropped by nft for a while (a black hole, as a pulled
# cable or a dead switch port looks), and a prefill killed and restarted at its address.
# Prints, per fault: rooms that failed (by reason), and the time from the heal (or the
# restart) to the first room that succeeded after it. Needs root, ip netns, nft.
#
#   scripts/outage-figures.sh [outage seconds ...]      (default: 10 40)
#   KVFERRY_BIN=target/release/kvferry scripts/outage-figures.sh 2 5
#
# CHECK=1 turns the figures into a test (what .ci/run does, with a 3 s liveness window):
# an outage shorter than the window (WINDOW_S) loses no room, a longer one fails rooms only as
# peer_unreachable, a SIGKILLed prefill's rooms fail only as connection_lost, and after every
# heal or restart new rooms succeed within HEAL_BOUND_MS (twice the 0.5 s target, so a debug
# build on a busy machine passes, while a wait on TCP retransmission backoff, 1.5 s and more
# after a 1.5 s outage, fails).
set -euo pipefail
# The nodes listen on a veth address, beyond loopback: they need a cluster token of their own.
export KVFERRY_TOKEN=${KVFERRY_TOKEN:-netns-check}
cd "$(dirname "$0")/.."
BIN=${KVFERRY_BIN:-target/release/kvferry}
OUTAGES=("$@")
[ ${#OUTAGES[@]} -eq 0 ] && OUTAGES=(10 40)
ROOMS=${ROOMS:-200000}
CHECK=${CHECK:-0}
WINDOW_S=${WINDOW_S:-15}
HEAL_BOUND_MS=${HEAL_BOUND_MS:-1000}
FAILED_CHECKS=0
P=kvf-fig-p
D=kvf-fig-d
KEEP=${WORK:+1}
WORK=${WORK:-$(mktemp -d)}   # a given WORK (logs of every process) is kept
PREFILL_PID=""

cleanup() {
    [ -n "$PREFILL_PID" ] && kill -9 "$PREFILL_PID" 2>/dev/null || true
    ip netns del "$P" 2>/dev/null || true
    ip netns del "$D" 2>/dev/null || true
    [ -n "$KEEP" ] || rm -rf "$WORK"
}
trap cleanup EXIT
cleanup_ns() { ip netns del "$P" 2>/dev/null || true; ip netns del "$D" 2>/dev/null || true; }
cleanup_ns

[ -x "$BIN" ] || cargo build --release -p kvferry-cli --bin kvferry
ip netns add "$P"
ip netns add "$D"
ip link add kvf-fig0 type veth peer name kvf-fig1
ip link set kvf-fig0 netns "$P"
ip link set kvf-fig1 netns "$D"
ip -n "$P" addr add 10.77.0.1/24 dev kvf-fig0
ip -n "$D" addr add 10.77.0.2/24 dev kvf-fig1
for ns in "$P" "$D"; do ip -n "$ns" link set lo up; done
ip -n "$P" link set kvf-fig0 up
ip -n "$D" link set kvf-fig1 up

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

start_prefill() {
    ip netns exec "$P" "$BIN" prefill --listen 10.77.0.1:7411 --pages-per-room 16 >>"$WORK/prefill.log" 2>&1 &
    PREFILL_PID=$!
    for _ in $(seq 100); do
        grep -q "listening" "$WORK/prefill.log" 2>/dev/null && return
        sleep 0.05
    done
}

black_hole() { # on | off
    if [ "$1" = on ]; then
        ip netns exec "$D" nft -f - <<'EOF'
table inet kvf_fig {
    chain in { type filter hook input priority 0; policy accept; iifname "kvf-fig1" drop; }
    chain out { type filter hook output priority 0; policy accept; oifname "kvf-fig1" drop; }
}
EOF
    else
        ip netns exec "$D" nft delete table inet kvf_fig
    fi
}

# Summarises a room log (wall-clock ms) from time $1 (wall-clock ms): failures by reason, and
# the first success at or after it. Sets NFAIL, REASONS (sorted, space-separated), FIRST and
# SUMMARY (one line for people).
summarise() {
    local from=$1 log=$2 out
    out=$(awk -v from="$from" '
        $3 != "success" && $3 != "shutdown" && $3 !~ /^refused:shut_down/ { failed[$3]++ ; nfail++ }
        $3 == "success" && $1 >= from && first == "" { first = $1 - from }
        END {
            printf "%d %s", nfail + 0, (first == "" ? "none" : first)
            for (r in failed) printf " %s=%d", r, failed[r]
            printf "\n"
        }' "$log")
    read -r NFAIL FIRST REASONS <<<"$out"
    REASONS=$(tr ' ' '\n' <<<"$REASONS" | sort | tr '\n' ' ')
    SUMMARY="rooms failed: $NFAIL ${REASONS}; first success $FIRST ms after"
}

# In CHECK mode: $1 names the fault, $2 the only reason a failed room may carry ("" for none).
check() {
    [ "$CHECK" = 1 ] || return 0
    local what=$1 allowed=$2 bad=""
    if [ -z "$allowed" ] && [ "$NFAIL" -ne 0 ]; then bad="lost $NFAIL rooms"; fi
    for r in $REASONS; do
        [ "${r%%=*}" = "$allowed" ] || bad="$bad; a room failed as ${r%%=*}"
    done
    if [ "$FIRST" = none ]; then
        bad="$bad; no room succeeded after it"
    elif [ "$FIRST" -gt "$HEAL_BOUND_MS" ]; then
        bad="$bad; first success $FIRST ms after it (bound $HEAL_BOUND_MS ms)"
    fi
    if [ -n "$bad" ]; then
        echo "FAILED $what: ${bad#; }" >&2
        FAILED_CHECKS=$((FAILED_CHECKS + 1))
    fi
}

start_decode() { # log file; prints the start time
    ip netns exec "$D" "$BIN" decode --connect 10.77.0.1:7411 --rooms "$ROOMS" --pages-per-room 16 \
        --concurrency 4 --json --room-log "$1" >"$1.report" 2>"$1.err" &
    DECODE_PID=$!
}

# SIGINT, as a user's Ctrl-C: the decode must end with its report within 10 s.
stop_decode() {
    kill -INT "$DECODE_PID"
    for _ in $(seq 100); do
        kill -0 "$DECODE_PID" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$DECODE_PID" 2>/dev/null; then
        echo "FAILED: the decode did not exit within 10 s of SIGINT" >&2
        FAILED_CHECKS=$((FAILED_CHECKS + 1))
        kill -9 "$DECODE_PID"
    fi
    wait "$DECODE_PID" || true
}

start_prefill
echo "== link black holes (nft drop on the decode's veth), liveness window ${WINDOW_S} s"
for secs in "${OUTAGES[@]}"; do
    log="$WORK/outage-$secs.log"
    start_decode "$log"
    sleep 3
    black_hole on
    sleep "$secs"
    black_hole off
    heal=$(now_ms)
    sleep 4
    stop_decode
    summarise "$heal" "$log"
    echo "outage ${secs} s: $SUMMARY the heal"
    if awk -v s="$secs" -v w="$WINDOW_S" 'BEGIN { exit !(s < w) }'; then
        check "outage ${secs} s (shorter than the window)" ""
    else
        check "outage ${secs} s (longer than the window)" peer_unreachable
    fi
done

echo "== prefill killed (SIGKILL) and restarted at the same address"
log="$WORK/restart.log"
start_decode "$log"
sleep 3
kill -9 "$PREFILL_PID"; wait "$PREFILL_PID" 2>/dev/null || true
sleep 1
restart=$(now_ms)
start_prefill
sleep 4
stop_decode
summarise "$restart" "$log"
echo "prefill restart: $SUMMARY the restart"
check "prefill restart" connection_lost
if [ "$FAILED_CHECKS" -ne 0 ]; then
    echo "$FAILED_CHECKS outage checks failed (logs: see above)" >&2
    exit 1
fi
