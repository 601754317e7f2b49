#!/usr/bin/env bash
# Serves MODEL on one machine as an SGLang prefill server and decode server over kvferry,
# behind sglang-router in PD mode: the recipe to copy. Tested with SGLang 0.5.23 and
# sglang-router 0.3.2 (python/scripts/sglang-pd-e2e.sh runs the same three on CPU).
#
#   python/scripts/sglang-pd-serve.sh MODEL [extra sglang.launch_server args...]
#   curl -s localhost:8000/generate -d '{"text": "hello", "sampling_params": {"max_new_tokens": 8}}'
#
# Needs a Python with sglang==0.5.23, sglang-router==0.3.2 and this wheel (pip install
# ./python); PY selects it (default: python3). Ports: ROUTER_PORT (8000), PREFILL_PORT (30000),
# DECODE_PORT (30001), BOOTSTRAP_PORT (8998, the prefill's bootstrap server the router names),
# KVFERRY_LISTEN_PORT (40000: prefill engine rank r's kvferry listener is on 40000 + r, so a
# restarted prefill is back where decode looks). PREFILL_ARGS and DECODE_ARGS add per-role
# arguments, e.g. PREFILL_ARGS="--tp-size 2" DECODE_ARGS="--tp-size 1" (kvferry moves each
# decode rank's heads), or "--enable-dp-attention --dp-size 2". Stop with Ctrl-C.
set -euo pipefail
[ $# -ge 1 ] || {
    sed -n '2,16p' "$0" >&2
    exit 2
}
model=$1
shift
py=${PY:-python3}
router_port=${ROUTER_PORT:-8000}
prefill_port=${PREFILL_PORT:-30000}
decode_port=${DECODE_PORT:-30001}
bootstrap_port=${BOOTSTRAP_PORT:-8998}
export KVFERRY_LISTEN_PORT=${KVFERRY_LISTEN_PORT:-40000}

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait' EXIT INT TERM
common=(--model-path "$model" --host 127.0.0.1 --disaggregation-transfer-backend kvferry
    --disaggregation-bootstrap-port "$bootstrap_port" "$@")
# shellcheck disable=SC2086 # PREFILL_ARGS / DECODE_ARGS are word lists on purpose
"$py" -m sglang.launch_server "${common[@]}" --port "$prefill_port" \
    --disaggregation-mode prefill ${PREFILL_ARGS:-} &
pids+=("$!")
# shellcheck disable=SC2086
"$py" -m sglang.launch_server "${common[@]}" --port "$decode_port" \
    --disaggregation-mode decode ${DECODE_ARGS:-} &
pids+=("$!")
for port in "$prefill_port" "$decode_port"; do
    until curl -sf -m 2 -o /dev/null "http://127.0.0.1:$port/health"; do sleep 2; done
done
"$py" -m sglang_router.launch_router --pd-disaggregation \
    --prefill "http://127.0.0.1:$prefill_port" "$bootstrap_port" \
    --decode "http://127.0.0.1:$decode_port" --host 127.0.0.1 --port "$router_port" &
pids+=("$!")
echo "serving $model on http://127.0.0.1:$router_port (prefill :$prefill_port, decode :$decode_port)"
wait
