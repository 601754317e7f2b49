"""Requests and rooms per second through kvferry's vLLM connector (vLLM's own Scheduler on
both sides, the connector's worker half over real KV tensors, no model), against the Python
API moving rooms of the same shape, in one sitting:

    $(python/scripts/vllm-venv.sh) python/bench/vllm_rooms.py --requests 400

Shape: 2 layers, one 16 KiB block per layer per 32 tokens (vLLM's CPU layout, float32, 2 KV
heads of 32), prompts of 128 tokens (4 blocks), `--concurrency` requests in flight. The
connector figure includes vLLM's scheduling of the prefill and decode steps; the Python
API figure is `python/bench/rooms.py` on the same layout (1 plane, 2 layers, 4 pages).
"""

import argparse
import os
import re
import subprocess
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
tests = os.path.join(os.path.dirname(here), "tests_vllm")
sys.path[:0] = [tests, os.path.join(os.path.dirname(here), "testing")]

import engine_processes  # noqa: E402
from harness import BLOCK_SIZE, HEAD_SIZE, KV_HEADS, LAYERS, Side  # noqa: E402
from test_connector import Prefill, free_port  # noqa: E402

args = None


def connector_path(transfer: bool = True, **layout) -> float:
    """Requests per second, each computed by the prefill and moved to the decode; without
    ``transfer`` the same flow of steps with the decode computing the prompt itself (what
    vLLM's scheduling costs here without kvferry). ``layout``: the harness's hybrid model
    (``window=`` tokens: layer 1 a sliding window)."""
    prefill = Prefill(free_port(), max_num_batched_tokens=args.prompt * args.concurrency, **layout)
    decode = Side("kv_consumer", free_port(), max_num_batched_tokens=args.prompt * args.concurrency, **layout)
    try:
        prompt = lambda i: [(i * 31 + k) % 997 + 3 for k in range(args.prompt)]  # noqa: E731
        started = time.perf_counter()
        for first in range(0, args.requests, args.concurrency):
            batch = [f"b{i}" for i in range(first, min(first + args.concurrency, args.requests))]
            for i, req_id in enumerate(batch):
                prefill.prefill(req_id, prompt(first + i), remote=transfer)
            got = dict(prefill.params() for _ in batch)
            for i, req_id in enumerate(batch):
                params = dict(got[req_id]) if transfer else None
                decode.add(req_id, prompt(first + i), 1, params)
            while len(decode.outputs.keys() & set(batch)) < len(batch):
                decode.step()
        elapsed = time.perf_counter() - started
        assert not decode.load_failures, decode.load_failures
        return args.requests / elapsed
    finally:
        decode.shutdown()
        prefill.stop()


def python_api() -> float:
    page = KV_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 4
    out = subprocess.run(
        [sys.executable, os.path.join(here, "rooms.py"), "--rooms", str(args.requests),
         "--concurrency", str(args.concurrency), "--layers", str(LAYERS), "--planes", "1",
         "--page-bytes", str(page), "--pages-per-room", str(args.prompt // BLOCK_SIZE)],
        capture_output=True, text=True, check=True,
    ).stdout
    print(out.strip())
    return float(re.search(r"(\d+) rooms/s", out).group(1))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--hybrid", action="store_true",
                   help="also a hybrid model (layer 1 a 48-token sliding window) in the same sitting")
    args = p.parse_args()
    # The prefill forks from a server that imported vLLM and the harness once (as the
    # suite's conftest.py starts it).
    engine_processes.start_forkserver(tests, ["harness", "test_connector", "kvferry.vllm"])
    api = python_api()
    through = connector_path()
    local = connector_path(transfer=False)
    print(f"connector: {through:.0f} requests/s (one room each); python API: {api:.0f} rooms/s; "
          f"connector / API: {through / api:.2f}; the same steps with the decode computing "
          f"(no kvferry): {local:.0f} requests/s; connector / no kvferry: {through / local:.2f}")
    if args.hybrid:
        for name, layout in (("sliding window", {"window": 48}),):
            moved, computed = connector_path(**layout), connector_path(transfer=False, **layout)
            print(f"hybrid, {name}: connector {moved:.0f} requests/s ({moved / through:.2f} of full "
                  f"attention's); the same steps with no kvferry {computed:.0f}; connector / no "
                  f"kvferry: {moved / computed:.2f}")
