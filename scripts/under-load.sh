#!/usr/bin/env bash
# The driver suites on a machine whose cores are shared, as inference servers share theirs:
# three busy loops per core at normal priority (LOOPS_PER_CORE), the suites run RUNS times
# (default 1) in a row; any failure fails the script. The loops stop when it exits.
#
#   scripts/under-load.sh            # what CI runs
#   RUNS=5 scripts/under-load.sh     # the acceptance run of issue 35
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-1}
per_core=${LOOPS_PER_CORE:-3}
suites=(--test drivers --test wakeups --test embedder --test device)

# Build first: the loops are there to load the tests, not the compiler.
cargo test -q -p kvferry-tests "${suites[@]}" --no-run

loops=$(( $(nproc) * per_core ))
pids=()
stop_loops() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true; }
trap stop_loops EXIT
for _ in $(seq "$loops"); do
    ( while :; do :; done ) &
    pids+=($!)
done

for i in $(seq "$runs"); do
    echo "== run $i of $runs: $loops busy loops on $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg)"
    start=$(date +%s)
    log=$(mktemp)
    if ! cargo test -q -p kvferry-tests "${suites[@]}" >"$log" 2>&1; then
        cat "$log"
        echo "run $i failed under load" >&2
        exit 1
    fi
    grep -E '^test result' "$log"
    rm -f "$log"
    echo "   run $i passed in $(( $(date +%s) - start )) s"
done
