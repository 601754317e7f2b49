"""End to end: kvferry as vLLM's KV connector, through vLLM's own engines on CPU.

Builds a tiny random-weight Llama and a word-level tokenizer (no download), serves it once
alone (the reference), then as a producer and a consumer engine over kvferry behind
``kvferry.vllm_proxy``, and fails unless:

- every greedy output through the proxy equals the reference, sequentially and concurrently,
  in pull mode and in push mode (the prefill sends each layer as its forward pass ends);
- the decode's kvferry metrics counted the rooms (``kvferry_rooms_succeeded_total``), and so
  did vLLM's own ``/metrics`` through the connector's stats
  (``vllm:kvferry_rooms_succeeded_total``);
- with the prefill engine killed after it computed a prompt, the decode's load fails with
  kvferry's reason (logged), vLLM recomputes the prompt, and the output still equals the
  reference, within a bounded time (no hang);
- a prefill restarted at the same address serves the next requests, outputs equal again;
- a router's mistakes sent straight to the decode (two prompts' rooms swapped, a shorter
  prompt's room, garbage params, a room id that names no room) each end in a refused load
  with its reason and a recomputed answer equal to the reference (garbage params within
  15 s each).

``--prefill-tp P --decode-tp D`` serves the prefill at TP P and the decode at TP D (vLLM's
CPU executor, one worker process per rank; the reference stays at TP 1) through the same
checks, each decode rank's node counting its rooms. CI runs it at TP 1 -> 1 (at 2 -> 1 on two cores it flaps: docs/PERFORMANCE.md).
``--kv-heads 1`` gives the model one KV head (MQA): at ``--prefill-tp 2`` both prefill ranks
hold it, and the decode loads it from one of them, the other an idle source.
``--hybrid`` gives the model's second layer a sliding window: vLLM's hybrid KV cache manager
runs (two KV cache groups over shared tensors) in every engine, the reference included.

Run with the venv of ``python/scripts/vllm-venv.sh`` (kvferry installed into it):
``$(python/scripts/vllm-venv.sh) python/scripts/vllm-pd-e2e.py``. Env: ``KVFERRY_E2E_KEEP=1``
keeps the work dir (logs). Prints one JSON line of figures at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

PY = sys.executable
WORDS = ("the a kv cache moves from prefill to decode over kvferry rooms with every byte "
         "checked and nothing lost when the network fails or a peer dies while pages move "
         "between two servers model token").split()


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


#: ``--hybrid``: the model's second layer attends over a sliding window of this many tokens.
WINDOW = 40


def build_model(out: str, hybrid: bool = False, kv_heads: int = 2) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    for i in range(len(vocab), 1000):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>", pad_token="<pad>").save_pretrained(out)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=32,
                      max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                      pad_token_id=3, tie_word_embeddings=False)
    if hybrid:
        # vLLM's Llama reads each layer's kind from ``layer_types``: a full-attention group
        # and a sliding-window group, each with its own block table.
        cfg.layer_types = ["full_attention", "sliding_attention"]
        cfg.sliding_window = WINDOW
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)  # large random weights: each token depends strongly on the KV
    model.to(torch.float32).save_pretrained(out)


class Engine:
    """One vLLM OpenAI server in its own process group."""

    def __init__(self, name: str, model: str, work: str, port: int, transfer: dict | None = None,
                 env: dict | None = None, tp: int = 1):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(work, f"{name}.log")
        cmd = [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
               "--host", "127.0.0.1", "--block-size", "32", "--max-model-len", "1024",
               "--dtype", "float32", "--no-enable-prefix-caching", "--max-num-seqs", "8",
               "--seed", "0"]
        if tp > 1:
            cmd += ["--tensor-parallel-size", str(tp)]
        if transfer is not None:
            # Stats on, as vLLM runs by default: the connector's reach its /metrics.
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
        else:
            cmd += ["--disable-log-stats"]
        e = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                 **(env or {}))
        self.log = open(self.log_path, "ab")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=e,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> float:
        """Waits for /health; returns the seconds since the engine's process was started."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready in {timeout} s; see {self.log_path}")

    def kill(self, sig=signal.SIGKILL) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()

    def text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def completion(base: str, prompt: str, extra: dict | None = None) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, **(extra or {})}
    return post(base + "/v1/completions", body)["choices"][0]["text"]


def prefill_params(base: str, prompt: str) -> dict:
    """What a prefill engine returns for a prompt it computed for a remote decode."""
    return post(base + "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]


def swapped_pair() -> tuple[str, str, str]:
    """Two different prompts of 100 words each, and a third of 60 words."""
    return (" ".join(WORDS[(j * 3) % len(WORDS)] for j in range(100)),
            " ".join(WORDS[(j * 5 + 1) % len(WORDS)] for j in range(100)),
            " ".join(WORDS[(j * 5 + 2) % len(WORDS)] for j in range(60)))


def prompts(n: int, base: int = 0) -> list[str]:
    out = []
    for i in range(n):
        k = 20 + (i * 37 + base) % 150  # 20..170 words: one to six blocks of 32
        out.append(" ".join(WORDS[(i * 7 + j * 3 + base) % len(WORDS)] for j in range(k)))
    return out


def decode_rooms(tp: int, metrics_base: int) -> list[int]:
    """``kvferry_rooms_succeeded_total`` of each decode rank's node."""
    counts = []
    for rank in range(tp):
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_base + rank}/metrics", timeout=5).read().decode()
        m = re.search(r'kvferry_rooms_succeeded_total\{role="decode"\} (\d+)', text)
        counts.append(int(m.group(1)) if m else 0)
    return counts


def cleanup_shm() -> None:
    # Killed engines leave their shared-memory rings behind.
    for f in os.listdir("/dev/shm"):
        if f.startswith("psm_"):
            try:
                os.unlink(os.path.join("/dev/shm", f))
            except OSError:
                pass


def check_start_lines(prefill: Engine, decode: Engine, prefill_tp: int, decode_tp: int,
                      hybrid: bool) -> None:
    # The connector's start line reaches vLLM's log at vLLM's default level, one per rank.
    for engine, role, tp in ((prefill, "prefill", prefill_tp), (decode, "decode", decode_tp)):
        for rank in range(tp):
            line = f"kvferry {role} node over vLLM's KV (TP rank {rank} of {tp})"
            assert line in engine.text(), f"no '{line}' in the {role}'s log"
        if hybrid:
            # vLLM's hybrid KV cache manager runs, and kvferry moves both groups.
            groups = f"KV cache groups [['full', 0], ['sliding_window', {WINDOW}]]"
            assert groups in engine.text(), f"no '{groups}' in the {role}'s log"


def start_proxies(work: str, prefill: Engine, decode: Engine, kv_addrs: str,
                  proxies: list[subprocess.Popen]) -> tuple[str, str]:
    """Starts the pull-mode and the push-mode router (each added to ``proxies`` as it starts)
    and waits for both; returns their URLs."""
    proxy_port = free_port()
    proxy = subprocess.Popen([PY, "-m", "kvferry.vllm_proxy", "--port", str(proxy_port),
                              "--host", "127.0.0.1", "--prefill", prefill.url,
                              "--decode", decode.url, "--timeout", "120"],
                             stdout=open(os.path.join(work, "proxy.log"), "ab"),
                             stderr=subprocess.STDOUT)
    proxies.append(proxy)
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    push_port = free_port()
    push_proxy = subprocess.Popen([PY, "-m", "kvferry.vllm_proxy", "--port", str(push_port),
                                   "--host", "127.0.0.1", "--push",
                                   "--prefill", f"{prefill.url}={kv_addrs}",
                                   "--decode", decode.url, "--timeout", "120"],
                                  stdout=open(os.path.join(work, "push-proxy.log"), "ab"),
                                  stderr=subprocess.STDOUT)
    proxies.append(push_proxy)
    push_url = f"http://127.0.0.1:{push_port}"
    for url in (proxy_url, push_url):
        for _ in range(60):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
    return proxy_url, push_url


def check_pull(proxy_url: str, decode: Engine, ps: list[str], reference: dict, decode_tp: int,
               metrics_base: int, figures: dict) -> None:
    # Sequentially, then concurrently.
    t0 = time.monotonic()
    for p in ps:
        got = completion(proxy_url, p)
        assert got == reference[p], f"sequential: {got!r} != {reference[p]!r}"
    figures["sequential_requests_per_s"] = round(len(ps) / (time.monotonic() - t0), 2)
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: completion(proxy_url, p), ps))
    figures["concurrent_requests_per_s"] = round(len(ps) / (time.monotonic() - t0), 2)
    for p, got in zip(ps, outs):
        assert got == reference[p], f"concurrent: {got!r} != {reference[p]!r}"
    # Every decode rank's node moved every request's room; a node publishes its counters
    # every few hundred milliseconds.
    deadline = time.monotonic() + 10
    while True:
        counted = decode_rooms(decode_tp, metrics_base)
        if all(n >= 2 * len(ps) for n in counted) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    figures["decode_rooms_succeeded_by_rank"] = counted
    assert all(n >= 2 * len(ps) for n in counted), f"decode rooms by rank: {counted}"
    # vLLM's own /metrics counts them too, through the connector's stats.
    deadline = time.monotonic() + 20
    while True:
        text = urllib.request.urlopen(decode.url + "/metrics", timeout=5).read().decode()
        v = re.search(r'vllm:kvferry_rooms_succeeded_total\{[^}]*\} ([0-9.e+]+)', text)
        if (v and float(v.group(1)) >= 2 * len(ps)) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert v and float(v.group(1)) >= 2 * len(ps), f"vLLM's metrics: {v and v.group(0)}"
    assert "vllm:kvferry_transfer_time_seconds_count" in text, "no transfer time histogram in vLLM's metrics"
    figures["vllm_metrics_rooms_succeeded"] = int(float(v.group(1)))


def check_push(push_url: str, decode: Engine, ps: list[str], reference: dict, figures: dict) -> None:
    # Push mode: the router tells both engines the room at once and the prefill sends
    # each layer as it is computed; the answers are the reference's.
    t0 = time.monotonic()
    for p in ps:
        got = completion(push_url, p)
        assert got == reference[p], f"push, sequential: {got!r} != {reference[p]!r}"
    figures["push_sequential_requests_per_s"] = round(len(ps) / (time.monotonic() - t0), 2)
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: completion(push_url, p), ps))
    for p, got in zip(ps, outs):
        assert got == reference[p], f"push, concurrent: {got!r} != {reference[p]!r}"
    assert "failed to load its KV" not in decode.text(), "a push room failed"


def check_router_mistakes(prefill: Engine, decode: Engine, reference: dict, decode_tp: int,
                          metrics_base: int, figures: dict) -> None:
    # A router's mistakes, sent straight to the decode. Two prompts of the same length,
    # each with the other's room, and one with a shorter prompt's room: the prefill
    # refuses each (prompt_mismatch), the decode recomputes, and every answer is the
    # reference's, never the other prompt's. A room id with a bit flipped names no room
    # at all: the decode cannot load it, recomputes, and says why in its log.
    a, b, short = swapped_pair()
    pa, pb, pshort = (prefill_params(prefill.url, x) for x in (a, b, short))
    t0 = time.monotonic()
    swapped = [completion(decode.url, a, {"kv_transfer_params": pb}),
               completion(decode.url, b, {"kv_transfer_params": pa}),
               completion(decode.url, a, {"kv_transfer_params": pshort})]
    figures["swapped_room_s"] = round((time.monotonic() - t0) / 3, 2)
    assert swapped == [reference[a], reference[b], reference[a]], "a swapped room changed an answer"
    assert "prompt_mismatch" in decode.text(), "the decode did not say why it recomputed"
    figures["swapped_rooms_refused"] = True
    # Garbage params: each request still answers as the reference, promptly, and the
    # engine keeps serving.
    p = prompts(1, base=9)[0]
    good = prefill_params(prefill.url, p)
    garbage = [{"do_remote_prefill": True, "kvferry_room": r, "kvferry_addrs": good["kvferry_addrs"],
                "kvferry_shape": good["kvferry_shape"]} for r in (-1, 0, "12", 1.5, [5], 2**64 - 1)]
    garbage += [{"do_remote_prefill": True, "kvferry_room": good["kvferry_room"], "kvferry_addrs": addrs,
                 "kvferry_shape": good["kvferry_shape"]}
                for addrs in (39600, [39600], [], ["localhost:1"], ["127.0.0.1:99999"], None)]
    garbage += [{"do_remote_prefill": True, "kvferry_room": good["kvferry_room"],
                 "kvferry_addrs": good["kvferry_addrs"], "kvferry_shape": s} for s in ("x", None, {"block_size": 7})]
    # The room the garbage is made from is loaded by its own request first (every decode
    # rank's node counts one room more), so the garbage names a room that is over. A
    # room left held would keep the prefill engine stepping for its 120 s lease (at
    # TP > 1 a worker process per rank spinning on its queue), which on a 2-core machine
    # starves the decode: a garbage request then took 90 s.
    before = decode_rooms(decode_tp, metrics_base)
    assert completion(decode.url, p, {"kv_transfer_params": good}) == reference[p]
    deadline = time.monotonic() + 10
    while decode_rooms(decode_tp, metrics_base) != [n + 1 for n in before]:
        assert time.monotonic() < deadline, f"the room was not loaded: {before} -> {decode_rooms(decode_tp, metrics_base)}"
        time.sleep(0.2)
    took = []
    for params in garbage:
        t0 = time.monotonic()
        got = completion(decode.url, p, {"kv_transfer_params": params})
        took.append(round(time.monotonic() - t0, 2))
        assert got == reference[p], f"garbage params {params!r}: {got!r} != {reference[p]!r}"
    figures["garbage_params_requests"] = len(garbage)
    figures["garbage_params_slowest_s"] = max(took)
    assert max(took) < 15, f"a request with garbage params took {max(took)} s (each: {took})"
    p = prompts(1, base=5)[0]
    wrong = dict(prefill_params(prefill.url, p))
    wrong["kvferry_room"] ^= 1
    logged = decode.text().count("failed to load its KV")
    got = completion(decode.url, p, {"kv_transfer_params": wrong})
    assert got == reference[p], "a recomputed prompt answers as the reference"
    assert decode.text().count("failed to load its KV") > logged, "the decode did not log the failed load"


MODEL = ""


def main(prefill_tp: int = 1, decode_tp: int = 1, hybrid: bool = False, kv_heads: int = 2) -> int:
    global MODEL
    work = tempfile.mkdtemp(prefix="kvferry-vllm-pd.")
    MODEL = os.path.join(work, "tiny-llama")
    build_model(MODEL, hybrid, kv_heads)
    figures: dict = {"prefill_tp": prefill_tp, "decode_tp": decode_tp, "hybrid": hybrid,
                     "kv_heads": kv_heads}
    engines: list[Engine] = []
    proxies: list[subprocess.Popen] = []
    ok = False
    try:
        ps = prompts(8)
        # The reference engine starts beside the prefill and the decode (three starts at once
        # take less time than one and then two on CI's two cores); it ends before any room.
        ref_engine = Engine("reference", MODEL, work, free_port())
        engines.append(ref_engine)

        # Each engine's ranks listen (and serve metrics) on consecutive ports.
        kv_base, metrics_base = 15600 + os.getpid() % 1000 * 8, 25600 + os.getpid() % 1000 * 8
        prefill_port, decode_port = free_port(), free_port()
        kv_addrs = ",".join(f"127.0.0.1:{kv_base + r}" for r in range(prefill_tp))

        def start_prefill() -> Engine:
            return Engine("prefill", MODEL, work, prefill_port, {
                "kv_connector": "KvferryConnector", "kv_connector_module_path": "kvferry.vllm",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"port": kv_base, "host": "127.0.0.1"},
            }, tp=prefill_tp)

        prefill = start_prefill()
        decode = Engine("decode", MODEL, work, decode_port, {
            "kv_connector": "KvferryConnector", "kv_connector_module_path": "kvferry.vllm",
            "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
            # At TP > 1 first contact waits on cores the engines' workers keep busy.
            "kv_connector_extra_config": {"port": kv_base + 4, "host": "127.0.0.1",
                                          "metrics_addr": f"127.0.0.1:{metrics_base}",
                                          "unreachable_timeout_ms": 3000 if prefill_tp == decode_tp == 1 else 20000},
        }, tp=decode_tp)
        engines += [prefill, decode]
        figures["engine_start_s"] = round(ref_engine.wait_ready(600), 1)
        reference = {p: completion(ref_engine.url, p)
                     for p in ps + prompts(4, base=5) + prompts(1, base=9) + list(swapped_pair())}
        assert len(set(reference.values())) > 1, "the tiny model answers every prompt alike"
        ref_engine.kill(signal.SIGTERM)
        engines.remove(ref_engine)
        figures["prefill_start_s"] = round(prefill.wait_ready(600), 1)
        figures["decode_start_s"] = round(decode.wait_ready(600), 1)
        check_start_lines(prefill, decode, prefill_tp, decode_tp, hybrid)
        proxy_url, push_url = start_proxies(work, prefill, decode, kv_addrs, proxies)
        check_pull(proxy_url, decode, ps, reference, decode_tp, metrics_base, figures)
        check_push(push_url, decode, ps, reference, figures)
        check_router_mistakes(prefill, decode, reference, decode_tp, metrics_base, figures)

        # A prefill killed after it computed a prompt: the decode's load fails with kvferry's
        # reason, vLLM recomputes, the answer is still the reference's, in bounded time.
        p = prompts(4, base=5)[1]
        params = prefill_params(prefill.url, p)
        prefill.kill()
        engines.remove(prefill)
        cleanup_shm()
        t0 = time.monotonic()
        got = completion(decode.url, p, {"kv_transfer_params": params})
        figures["load_from_killed_prefill_s"] = round(time.monotonic() - t0, 2)
        assert got == reference[p], f"after the kill: {got!r} != {reference[p]!r}"
        assert figures["load_from_killed_prefill_s"] < (30 if prefill_tp == decode_tp == 1 else 50)

        # Restarted at the same addresses: the next requests match again.
        prefill = start_prefill()
        engines.append(prefill)
        prefill.wait_ready(600)
        for p in prompts(4, base=5)[2:]:
            got = completion(proxy_url, p)
            assert got == reference[p], f"after the restart: {got!r} != {reference[p]!r}"
        ok = True
        figures["ok"] = True
        print(json.dumps(figures))
        return 0
    finally:
        for proxy in proxies:
            proxy.terminate()
        for e in engines:
            e.kill(signal.SIGTERM)
        cleanup_shm()
        if not ok or os.environ.get("KVFERRY_E2E_KEEP"):
            print(f"vllm-pd-e2e: logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill-tp", type=int, default=1)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--hybrid", action="store_true",
                    help=f"a model whose second layer has a {WINDOW}-token sliding window (vLLM's hybrid KV cache manager)")
    ap.add_argument("--kv-heads", type=int, default=2,
                    help="the model's KV heads (of 4 attention heads): 1 with --prefill-tp 2 makes "
                         "every prefill rank hold the one head")
    args = ap.parse_args()
    sys.exit(main(args.prefill_tp, args.decode_tp, args.hybrid, args.kv_heads))
