"""Requests per second through kvferry's vLLM connector for each TP layout, against the same
TP on both sides, in one sitting (vLLM's Scheduler per engine and one process per rank, as
``python/tests_vllm/ranks.py`` runs them; no model):

    $(python/scripts/vllm-venv.sh) python/bench/vllm_layouts.py --requests 96

Layouts: prefill TP -> decode TP of 1 -> 1, 2 -> 2 (rank to rank, whole blocks), 2 -> 1 and
1 -> 2 (each decode rank its KV heads, from the ranks holding them), and a PP 2 prefill to a
TP 1 decode. Shape: 2 layers, 2 KV heads of 32 (float32), blocks of 32 tokens, prompts of
``--prompt`` tokens, ``--concurrency`` requests in flight. Each figure includes vLLM's
scheduling and one round trip per step to every rank's process, so it is the connector's
rate through this harness, not kvferry's alone; the ratios compare layouts on equal terms.
With ``--state`` the model's layer 1 keeps a GDN layer's recurrent state (split by TP rank
between different sizes; no PP layout: hybrid models are refused at PP > 1).
"""

import argparse
import os
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
tests = os.path.join(os.path.dirname(here), "tests_vllm")
sys.path[:0] = [tests, os.path.join(os.path.dirname(here), "testing")]

import engine_processes  # noqa: E402
from ranks import Ranks  # noqa: E402
from test_tensor_parallel import drain, free_ports, prefill_all  # noqa: E402

args = None

LAYOUTS = [("1 -> 1", 1, 1, 1), ("2 -> 2", 2, 1, 2), ("2 -> 1", 2, 1, 1), ("1 -> 2", 1, 1, 2),
           ("PP 2 -> 1", 1, 2, 1)]


def rate(prefill_tp: int, prefill_pp: int, decode_tp: int) -> float:
    """Requests per second, each prefilled, moved and loaded on every decode rank."""
    blocks = 4 * args.concurrency * -(-args.prompt // 32)
    made = []
    try:
        state = {"mamba": True} if args.state else {}
        made.append(Ranks("kv_producer", free_ports(prefill_tp * prefill_pp), prefill_tp, num_blocks=blocks,
                          pp=prefill_pp, **state))
        made.append(Ranks("kv_consumer", free_ports(decode_tp), decode_tp, num_blocks=blocks, **state))
        prefill, decode = made
        prompt = lambda i: [(i * 31 + k) % 997 + 3 for k in range(args.prompt)]  # noqa: E731
        started = time.perf_counter()
        for first in range(0, args.requests, args.concurrency):
            batch = {f"r{i}": prompt(i) for i in range(first, min(first + args.concurrency, args.requests))}
            params = prefill_all(prefill, batch)
            for req_id, tokens in batch.items():
                decode.add(req_id, tokens, 1, dict(params[req_id]))
            end = time.monotonic() + 60
            while len(decode.outputs.keys() & batch.keys()) < len(batch):
                assert time.monotonic() < end, f"decode still waits: {decode.scheduler.get_request_counts()}"
                decode.step()
                prefill.step()
        elapsed = time.perf_counter() - started
        assert not decode.load_failures, decode.load_failures
        assert len(decode.loaded) == args.requests, len(decode.loaded)
        assert drain(prefill), "the prefill still holds blocks"
        return args.requests / elapsed
    finally:
        for engine in reversed(made):
            engine.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--state", action="store_true", help="a GDN layer's recurrent state in every request")
    args = p.parse_args()
    # The ranks fork from a server that imported vLLM and the harness once (as the suite's
    # conftest.py starts it).
    engine_processes.start_forkserver(tests, ["harness", "ranks", "kvferry.vllm"])
    rates = {}
    layouts = [x for x in LAYOUTS if not (args.state and x[2] > 1)]
    for name, prefill_tp, prefill_pp, decode_tp in layouts:
        rates[name] = rate(prefill_tp, prefill_pp, decode_tp)
        print(f"{name:10} {rates[name]:7.1f} requests/s", flush=True)
    same = {1: rates["1 -> 1"], 2: rates["2 -> 2"]}
    for name, prefill_tp, prefill_pp, decode_tp in layouts[2:]:
        # Against the same-TP layout with as many rank processes on the wider side.
        base = same[max(prefill_tp * prefill_pp, decode_tp)]
        print(f"{name} / same TP {max(prefill_tp * prefill_pp, decode_tp)}: {rates[name] / base:.2f}")
