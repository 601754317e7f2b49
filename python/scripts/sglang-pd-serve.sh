#!/usr/bin/env bash
# Serves MODEL on one machine as an SGLang prefill server and decode server over kvferry,
# behind sglang-router in PD mode: the recipe to copy. Tested with SGLang 0.5.23 and
# sglang-router 0.3.2 (python/scripts/sglang-pd-e2e.sh runs this script on CPU too).
#
#   python/scripts/sglang-pd-serve.sh [--cpu] MODEL [extra sglang.launch_server args...]
#   curl -s localhost:8000/generate -d '{"text": "hello", "sampling_params": {"max_new_tokens": 8}}'
#
# Needs a Python with sglang==0.5.23, its server packages, sglang-router==0.3.2 and this wheel
# (python/scripts/sglang-venv.sh, then pip install ./python); PY selects it (default: python3).
# --cpu (the default where torch sees no CUDA device) runs SGLang's CPU paths: see below.
# Ports: ROUTER_PORT (8000), PREFILL_PORT (30000), DECODE_PORT (30001), BOOTSTRAP_PORT (8998,
# the prefill's bootstrap server the router names), KVFERRY_LISTEN_PORT (40000: prefill engine
# rank r's kvferry listener is on 40000 + r, so a restarted prefill is back where decode
# looks; set but empty: any free port). PREFILL_ARGS and DECODE_ARGS add per-role arguments,
# e.g. PREFILL_ARGS="--tp-size 2" DECODE_ARGS="--tp-size 1" (kvferry moves each decode rank's
# heads), or "--enable-dp-attention --dp-size 2". Logs go to LOG_DIR (a new temp dir by
# default). A server that dies while starting ends the script at once with its last log
# lines; "serving" is printed once the router has answered a request. Stop with Ctrl-C.
set -euo pipefail
usage() {
    sed -n '2,19p' "$0" >&2
    exit 2
}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${PY:-python3}
cpu=""
if [ "${1:-}" = "--cpu" ]; then
    cpu=1
    shift
fi
[ $# -ge 1 ] || usage
model=$1
shift
if [ -z "$cpu" ] && ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "sglang-pd-serve: torch sees no CUDA device: running SGLang's CPU paths (--cpu)" >&2
    cpu=1
fi
"$py" -c 'import sglang, sglang_router, kvferry.sglang' || {
    echo "sglang-pd-serve: $py lacks sglang, sglang-router or kvferry (python/scripts/sglang-venv.sh, then pip install ./python)" >&2
    exit 2
}
router_port=${ROUTER_PORT:-8000}
prefill_port=${PREFILL_PORT:-30000}
decode_port=${DECODE_PORT:-30001}
bootstrap_port=${BOOTSTRAP_PORT:-8998}
export KVFERRY_LISTEN_PORT=${KVFERRY_LISTEN_PORT-40000}
logs=${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/kvferry-sglang-serve.XXXXXX")}
mkdir -p "$logs"

common=(--model-path "$model" --host 127.0.0.1 --disaggregation-transfer-backend kvferry
    --disaggregation-bootstrap-port "$bootstrap_port")
prefill_extra=()
decode_extra=()
if [ -n "$cpu" ]; then
    # SGLang 0.5.23 on CPU, none of it kvferry's (sglang-pd-e2e.sh says why for each):
    # SGLANG_USE_CPU_ENGINE takes its CPU paths; a pure-torch stand-in replaces the sgl_kernel
    # CPU ops it imports (no CPU wheel is published); the decode's retraction backup must not
    # pin host memory with CUDA; the prefill's overlap loop records a CUDA event.
    export SGLANG_USE_CPU_ENGINE=1
    export PYTHONPATH="$here/sglang-cpu${PYTHONPATH:+:$PYTHONPATH}"
    common+=(--device cpu --attention-backend torch_native --disable-cuda-graph)
    prefill_extra+=(--disable-overlap-schedule)
    decode_extra+=(--disaggregation-decode-retraction-backup cpu_tensor)
fi
common+=("$@")

pids=()
names=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null' EXIT
trap 'exit 130' INT TERM
start() { # NAME ARGS...: starts a process logging to $logs/NAME.log
    local name=$1
    shift
    "$@" >"$logs/$name.log" 2>&1 &
    pids+=("$!")
    names+=("$name")
}
# Fails at once, with its last log lines, if a process started here has died.
check_alive() {
    local i
    for i in "${!pids[@]}"; do
        if ! kill -0 "${pids[$i]}" 2>/dev/null; then
            echo "sglang-pd-serve: the ${names[$i]} process exited; the end of $logs/${names[$i]}.log:" >&2
            tail -n 30 "$logs/${names[$i]}.log" >&2
            exit 1
        fi
    done
}
# shellcheck disable=SC2086 # PREFILL_ARGS / DECODE_ARGS are word lists on purpose
start prefill "$py" -m sglang.launch_server "${common[@]}" --port "$prefill_port" \
    --disaggregation-mode prefill "${prefill_extra[@]}" ${PREFILL_ARGS:-}
# shellcheck disable=SC2086
start decode "$py" -m sglang.launch_server "${common[@]}" --port "$decode_port" \
    --disaggregation-mode decode "${decode_extra[@]}" ${DECODE_ARGS:-}
echo "sglang-pd-serve: starting prefill :$prefill_port and decode :$decode_port (logs in $logs)"
for port in "$prefill_port" "$decode_port"; do
    until curl -sf -m 2 -o /dev/null "http://127.0.0.1:$port/health"; do
        check_alive
        sleep 1
    done
done
# The router's health checks and circuit breaker decide how soon a restarted prefill is used
# again (sglang-router's defaults: 60 s each); 5 s here.
start router "$py" -m sglang_router.launch_router --pd-disaggregation \
    --prefill "http://127.0.0.1:$prefill_port" "$bootstrap_port" \
    --decode "http://127.0.0.1:$decode_port" --host 127.0.0.1 --port "$router_port" \
    --health-check-interval-secs 5 --cb-timeout-duration-secs 5
# The router answers /health before it activated its workers: wait for a request it serves.
until curl -sf -m 30 -o /dev/null "http://127.0.0.1:$router_port/generate" \
    -H 'Content-Type: application/json' \
    -d '{"text": "hello", "sampling_params": {"max_new_tokens": 1}}'; do
    check_alive
    sleep 1
done
echo "serving $model on http://127.0.0.1:$router_port (prefill :$prefill_port, decode :$decode_port, logs in $logs)"
while true; do
    check_alive
    sleep 2
done
