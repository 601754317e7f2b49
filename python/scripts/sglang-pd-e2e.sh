#!/usr/bin/env bash
# End-to-end check of kvferry as SGLang's PD transfer backend, on CPU, with no download
# beyond PyPI: builds a tiny random-weight Llama and a word-level tokenizer into a temp dir,
# serves it once without disaggregation (the reference), then as a prefill server and a
# decode server with --disaggregation-transfer-backend kvferry, routes the same greedy
# requests to both the way SGLang's router does (same bootstrap_host/port/room to prefill
# and decode, concurrently), and fails unless every decode output equals the reference and
# both servers logged their kvferry node, and that the decode's kvferry metrics (served at
# KVFERRY_METRICS_ADDR) counted the rooms.
#
# Needs the venv of sglang-venv.sh (created if missing) with this wheel installed.
#
# CPU caveats, all SGLang's, none kvferry's:
#  - SGLANG_USE_CPU_ENGINE=1 is what makes SGLang take its CPU paths; without it a CPU run
#    ends in `from vllm._custom_ops import rotary_embedding` (rotary_embedding/base.py).
#  - With it, SGLang imports a few CPU kernels from `sgl_kernel` unconditionally
#    (kernels/ops/kvcache/cache_move.py, srt/mem_cache/allocation.py, kernels/ops/speculative/*),
#    and sgl-kernel's CPU build is not published on PyPI (only CUDA wheels, no sdist). A
#    pure-torch stand-in for the two ops a plain Llama uses (python/scripts/sglang-cpu, shared
#    with sglang-pd-serve.sh --cpu) goes on PYTHONPATH; it registers
#    no torch.ops.sgl_kernel ops, so every layer takes its native torch path.
#  - Decode: --disaggregation-decode-retraction-backup cpu_tensor, since the default
#    host_pool pins host memory with cudaHostRegister.
#  - Layouts: one rank per server. SGLang 0.5.23's CPU path cannot run TP 2 here (its
#    parallel state builds a pynccl communicator, "Expected a cuda device, but got: cpu";
#    SGLANG_CPU_OMP_THREADS_BIND=0|1 gets past the NUMA check to that), so the layout beyond
#    the simplest is a decode-side prefix: --disaggregation-decode-enable-radix-cache, and
#    the concurrent round asks for the prompts the sequential round left in the decode's
#    cache. Heterogeneous TP, MLA, DP attention and PP run through SGLang's own classes in
#    python/tests_sglang/test_layouts.py.
#  - Prefill: --disable-overlap-schedule, since the overlap loop's early send of a cached
#    prefix records a torch.cuda.Event (disaggregation/prefill.py,
#    maybe_send_cached_prefix_chunk). The early send itself stays on: the prompts share a
#    prefix, so later rooms go to kvferry in two chunks.
#
# Env: KVFERRY_CACHE (venv root), KVFERRY_E2E_KEEP=1 keeps the temp dir (logs) on exit.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=${KVFERRY_CACHE:-$HOME/.cache/kvferry}/sglang-0.5.23
if [ -x "$venv/bin/python" ] && [ -f "$venv/.kvferry-complete-3" ]; then
    py=$venv/bin/python
else
    py=$(bash "$here/sglang-venv.sh")
fi
"$py" -c 'import kvferry.sglang' 2>/dev/null || {
    echo "kvferry is not installed in $venv (build it into that venv first)" >&2
    exit 2
}

start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/kvferry-sglang-pd.XXXXXX")
pgids=()
stop_servers() {
    local g
    for g in "${pgids[@]}"; do kill -TERM -- "-$g" 2>/dev/null || true; done
    for _ in $(seq 1 40); do # SGLang takes ~8 s to stop, then SIGKILLs its own tree
        local alive=0
        for g in "${pgids[@]}"; do kill -0 -- "-$g" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.5
    done
    for g in "${pgids[@]}"; do kill -KILL -- "-$g" 2>/dev/null || true; done
    pgids=()
}
cleanup() {
    local rc=$?
    stop_servers
    if [ "$rc" != 0 ]; then
        for f in "$work"/*.log; do
            [ -f "$f" ] || continue
            echo "---- last lines of $f" >&2
            grep -v -e Warning -e 'warnings.warn' -e 'Ignore import error' -e 'server_args=' "$f" | tail -25 >&2 || true
        done
    fi
    if [ "${KVFERRY_E2E_KEEP:-0}" = 1 ]; then
        echo "kept $work" >&2
    else
        rm -rf "$work"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- the tiny model, its tokenizer, and the sgl_kernel stand-in
mkdir -p "$work/model"
cat >"$work/make_tiny.py" <<'EOF'
import sys, torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = sys.argv[1]
torch.manual_seed(0)
words = ("the quick brown fox jumps over lazy dog a cat sat on mat hello world kv cache "
         "prefill decode node moves pages from one to another server model token").split()
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
for w in words:
    vocab.setdefault(w, len(vocab))
for i in range(len(vocab), 1000):
    vocab[f"w{i}"] = i
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.decoder = decoders.WordPiece(prefix="##")
tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                        eos_token="</s>", pad_token="<pad>").save_pretrained(out)
cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)
model = LlamaForCausalLM(cfg)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.5)  # large random weights: each token depends strongly on the KV
model.to(torch.bfloat16).save_pretrained(out)
EOF
"$py" "$work/make_tiny.py" "$work/model" >"$work/make_tiny.log" 2>&1

# ---- the requests, and the check
cat >"$work/client.py" <<'EOF'
"""client.py reference URL OUT | client.py pd|probe PREFILL DECODE BOOTSTRAP_PORT REF"""
import json, random, sys, threading, time, requests

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world kv cache",
    "a cat sat on the mat and the dog sat on a mat",
    "prefill node moves pages from one server to another server " * 4,
    "decode",
]
PARAMS = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def generate(url, body):
    r = requests.post(url + "/generate", json=body, timeout=120)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def pd_request(prefill, decode, bport, text, out, i):
    body = {"text": text, "sampling_params": PARAMS, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bport, "bootstrap_room": random.randrange(1 << 63)}
    res, errs = {}, []

    def go(name, url):
        try:
            res[name] = generate(url, body)
        except Exception as e:  # noqa: BLE001
            errs.append(f"{name}: {e}")

    ts = [threading.Thread(target=go, args=a) for a in (("prefill", prefill), ("decode", decode))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out[i] = errs or res["decode"]["output_ids"]


if sys.argv[1] == "reference":
    ids = [generate(sys.argv[2], {"text": p, "sampling_params": PARAMS})["output_ids"] for p in PROMPTS]
    json.dump(ids, open(sys.argv[3], "w"))
    sys.exit(0)

if sys.argv[1] == "router":
    # Through sglang-router in PD mode: it adds the bootstrap fields itself.
    router, ref = sys.argv[2], json.load(open(sys.argv[3]))
    failed = 0
    for i, p in enumerate(PROMPTS):
        began = time.monotonic()
        try:
            got = generate(router, {"text": p, "sampling_params": PARAMS})["output_ids"]
        except Exception as e:  # noqa: BLE001
            got = str(e)
        ok = got == ref[i]
        failed += not ok
        print(f"router     prompt {i}: {'ok ' if ok else 'MISMATCH'} in {time.monotonic() - began:.1f} s"
              + ("" if ok else f" decode={got} reference={ref[i]}"))
    sys.exit(1 if failed else 0)
prefill, decode, bport, ref = sys.argv[2], sys.argv[3], int(sys.argv[4]), json.load(open(sys.argv[5]))
if sys.argv[1] == "probe":
    # The first request after a prefill restart: it must succeed, and not wait for any
    # deadline (the decode finds the prefill's new kvferry address through the bootstrap
    # server).
    out = [None]
    began = time.monotonic()
    pd_request(prefill, decode, bport, PROMPTS[1], out, 0)
    took = time.monotonic() - began
    print(f"first request after the restart: {'ok' if out[0] == ref[1] else out[0]} in {took:.1f} s")
    sys.exit(0 if out[0] == ref[1] and took < 20 else 1)
failed = 0
# One request at a time, then all at once (several kvferry rooms in flight).
for mode in ("sequential", "concurrent"):
    out = [None] * len(PROMPTS)
    if mode == "sequential":
        for i, p in enumerate(PROMPTS):
            pd_request(prefill, decode, bport, p, out, i)
    else:
        ts = [threading.Thread(target=pd_request, args=(prefill, decode, bport, p, out, i))
              for i, p in enumerate(PROMPTS)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    for i, (got, want) in enumerate(zip(out, ref)):
        ok = got == want
        failed += not ok
        print(f"{mode:10} prompt {i}: {'ok ' if ok else 'MISMATCH'} decode={got}"
              + ("" if ok else f" reference={want}"))
print(f"{2 * len(PROMPTS) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
EOF

read -r port_single port_prefill port_decode port_bootstrap nccl_single nccl_prefill nccl_decode port_metrics port_router < <(
    "$py" - <<'EOF'
# Below the kernel's ephemeral range: a port bound to 0 and released here could be handed
# again to one of the sockets the servers open on port 0 before their own --port binds it.
import random, socket
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
ports = []
while len(ports) < 9:
    port = random.randrange(10000, low)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        continue
    finally:
        s.close()
    if port not in ports:
        ports.append(port)
print(*ports)
EOF
)

export SGLANG_USE_CPU_ENGINE=1
# A prefill request whose decode never reaches it (the probe after the restart) ends in 20 s
# instead of SGLang's default 300.
export SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=20
export PYTHONPATH="$here/sglang-cpu${PYTHONPATH:+:$PYTHONPATH}"
common=(--model-path "$work/model" --device cpu --host 127.0.0.1 --attention-backend torch_native
    --disable-cuda-graph --max-total-tokens 4096 --mem-fraction-static 0.05 --random-seed 0
    --log-level info)

launch() { # NAME MODULE ARGS...: starts a server in its own process group
    local name=$1
    shift
    setsid "$py" -m "$@" >"$work/$name.log" 2>&1 &
    pgids+=("$!")
    disown "$!" # SGLang ends itself with SIGKILL: keep bash from reporting it
}
wait_healthy() { # NAME PORT
    local deadline=$((SECONDS + 240))
    until curl -sf -m 2 -o /dev/null "http://127.0.0.1:$2/health"; do
        if ((SECONDS > deadline)); then
            echo "$1 server did not become healthy in 240 s" >&2
            return 1
        fi
        if grep -q -e 'Received sigquit' -e 'Scheduler hit an exception' "$work/$1.log"; then
            echo "$1 server failed to start" >&2
            return 1
        fi
        sleep 2
    done
    echo "$1 server healthy after $((SECONDS - start)) s"
}

# ---- reference: one server, no disaggregation
launch single sglang.launch_server "${common[@]}" --port "$port_single" --nccl-port "$nccl_single"
wait_healthy single "$port_single"
"$py" "$work/client.py" reference "http://127.0.0.1:$port_single" "$work/reference.json"
stop_servers

# ---- PD: prefill through kvferry's launcher, decode through SGLang's own (the plugin entry
# point registers kvferry there): both ways of selecting the backend are exercised.
pd=(--disaggregation-transfer-backend kvferry --disaggregation-bootstrap-port "$port_bootstrap")
launch prefill kvferry.sglang.launch_server "${common[@]}" "${pd[@]}" --port "$port_prefill" \
    --nccl-port "$nccl_prefill" --disaggregation-mode prefill --disable-overlap-schedule
KVFERRY_METRICS_ADDR=127.0.0.1:$port_metrics \
    launch decode sglang.launch_server "${common[@]}" "${pd[@]}" --port "$port_decode" \
    --nccl-port "$nccl_decode" --disaggregation-mode decode \
    --disaggregation-decode-retraction-backup cpu_tensor --disaggregation-decode-enable-radix-cache
wait_healthy prefill "$port_prefill"
wait_healthy decode "$port_decode"

status=0
"$py" "$work/client.py" pd "http://127.0.0.1:$port_prefill" "http://127.0.0.1:$port_decode" \
    "$port_bootstrap" "$work/reference.json" || status=1
# The decode's radix cache holds the prompts of the sequential round when the concurrent
# round asks for them again: those rooms move only the pages after the cached prefix.
if line=$(grep -m1 "leaves the .* pages this decode holds in place" "$work/decode.log"); then
    echo "decode: ${line#*] }"
else
    echo "no room had a decode-side prefix (--disaggregation-decode-enable-radix-cache)" >&2
    status=1
fi
for side in prefill decode; do
    line=$(grep -m1 "kvferry $side node for engine rank" "$work/$side.log" || true)
    if [ -z "$line" ]; then
        echo "$side server did not log its kvferry node" >&2
        status=1
    else
        echo "$side: ${line#*] }"
    fi
done
# kvferry's metrics, served by the decode scheduler (engine rank 0: the port as given),
# count every room the requests above moved.
# The exporter publishes the core's counters on its own tick: read until they caught up.
for _ in $(seq 1 20); do
    succeeded=$(curl -sf -m 5 "http://127.0.0.1:$port_metrics/metrics" |
        awk '/^kvferry_rooms_succeeded_total\{.*role="decode"/ { print $2 }')
    [ "${succeeded:-0}" -ge 10 ] 2>/dev/null && break
    sleep 0.5
done
if [ "${succeeded:-0}" -ge 10 ] 2>/dev/null; then
    echo "decode metrics: kvferry_rooms_succeeded_total $succeeded"
else
    echo "decode metrics: kvferry_rooms_succeeded_total is '${succeeded}', want >= 10" >&2
    status=1
fi
if grep -E 'transfer failed|handshake failed|bootstrap failed|KVTransferError' "$work/prefill.log" "$work/decode.log" >&2; then
    echo "a kvferry room failed (above)" >&2
    status=1
fi

# ---- the same requests through sglang-router in PD mode, as users deploy it
launch router sglang_router.launch_router --pd-disaggregation \
    --prefill "http://127.0.0.1:$port_prefill" "$port_bootstrap" \
    --decode "http://127.0.0.1:$port_decode" --host 127.0.0.1 --port "$port_router"
# The router answers /health before it has checked and activated its workers: ready is
# when a one-token request goes through.
deadline=$((SECONDS + 120))
until curl -sf -m 30 -o /dev/null "http://127.0.0.1:$port_router/generate" \
    -H 'content-type: application/json' \
    -d '{"text": "ready", "sampling_params": {"max_new_tokens": 1}}'; do
    if ((SECONDS > deadline)); then
        echo "the router did not serve a request in 120 s" >&2
        status=1
        break
    fi
    sleep 1
done
"$py" "$work/client.py" router "http://127.0.0.1:$port_router" "$work/reference.json" || status=1

# ---- the prefill server is SIGKILLed while idle and started again at the same addresses
# (its kvferry listener gets a new port): decode finds it again through the bootstrap server,
# and the very first request after the restart, like every one after it, matches the
# reference without waiting for a deadline.
kill -KILL -- "-${pgids[0]}"
sleep 2
launch prefill2 kvferry.sglang.launch_server "${common[@]}" "${pd[@]}" --port "$port_prefill" \
    --nccl-port "$nccl_prefill" --disaggregation-mode prefill --disable-overlap-schedule
wait_healthy prefill2 "$port_prefill"
args=("http://127.0.0.1:$port_prefill" "http://127.0.0.1:$port_decode" "$port_bootstrap" "$work/reference.json")
"$py" "$work/client.py" probe "${args[@]}" || status=1
"$py" "$work/client.py" pd "${args[@]}" || status=1
"$py" "$work/client.py" router "http://127.0.0.1:$port_router" "$work/reference.json" || status=1
stop_servers

# ---- the serve recipe, run as a user runs it. A model that does not load: the script ends
# within seconds, naming the server and showing its log's end, instead of waiting.
began=$SECONDS
set +e
PY=$py ROUTER_PORT=$port_router PREFILL_PORT=$port_prefill DECODE_PORT=$port_decode \
    BOOTSTRAP_PORT=$port_bootstrap LOG_DIR="$work/serve-bad" \
    timeout 180 bash "$here/sglang-pd-serve.sh" --cpu "$work/no-such-model" >"$work/serve-bad.out" 2>&1
rc=$?
set -e
if [ "$rc" = 1 ] && grep -q "process exited; the end of" "$work/serve-bad.out"; then
    echo "serve script: a server that died at start ended it in $((SECONDS - began)) s (exit 1)"
else
    echo "serve script: a server that died at start gave exit $rc after $((SECONDS - began)) s:" >&2
    tail -n 20 "$work/serve-bad.out" >&2
    status=1
fi
# The tiny model served by the script (any kvferry port): "serving" only once the router
# answered, and its answers are the reference's.
began=$SECONDS
PY=$py ROUTER_PORT=$port_router PREFILL_PORT=$port_prefill DECODE_PORT=$port_decode \
    BOOTSTRAP_PORT=$port_bootstrap LOG_DIR="$work/serve" KVFERRY_LISTEN_PORT="" \
    setsid bash "$here/sglang-pd-serve.sh" --cpu "$work/model" --max-total-tokens 4096 \
    --mem-fraction-static 0.05 --random-seed 0 >"$work/serve.out" 2>&1 &
serve_pgid=$!
pgids+=("$serve_pgid")
until grep -q "^serving " "$work/serve.out"; do
    if ! kill -0 "$serve_pgid" 2>/dev/null || ((SECONDS - began > 300)); then
        echo "serve script did not serve:" >&2
        tail -n 30 "$work/serve.out" >&2
        status=1
        break
    fi
    sleep 1
done
if grep -q "^serving " "$work/serve.out"; then
    echo "serve script: serving after $((SECONDS - began)) s"
    "$py" "$work/client.py" router "http://127.0.0.1:$port_router" "$work/reference.json" || status=1
fi
echo "sglang-pd-e2e: $([ "$status" = 0 ] && echo PASS || echo FAIL) in $((SECONDS - start)) s"
exit "$status"
