"""Rooms per second through kvferry's SGLang backend, on the shape of `rooms.py` and the Rust
demo (8 layers of K and V, 16 KiB pages, 4 pages a room, 16 rooms in flight):

    sgl=$(python/scripts/sglang-venv.sh)
    (cd python/bench && "$sgl" sglang_rooms.py --rooms 2000 --concurrency 16)

SGLang's classes as its schedulers call them: a prefill process (SGLang's bootstrap server,
a sender per room: poll until WaitingForInput, init, send, poll until Success, clear) and
this process as the decode (a receiver per room: init, poll, send_metadata, poll until
Success, every byte checked with numpy, clear).
"""

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--rooms", type=int, default=2000)
p.add_argument("--concurrency", type=int, default=16)
p.add_argument("--layers", type=int, default=8)
p.add_argument("--page-bytes", type=int, default=16384)
p.add_argument("--pages-per-room", type=int, default=4)
args = p.parse_args()
PAGES = args.concurrency * args.pages_per_room
BUFFERS = 2 * args.layers


def pool(fill):
    kv = np.zeros((BUFFERS, PAGES, args.page_bytes), dtype=np.uint8)
    if fill:
        for b in range(BUFFERS):
            kv[b] = ((np.arange(PAGES * args.page_bytes) * (b + 3)) % 251).reshape(PAGES, -1)
    return kv


def rank(mode, port, kv):
    import kvferry.sglang

    kvferry.sglang.install()
    import torch
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode, KVClassType, MetadataBuffers, TransferBackend, get_kv_class)
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", host="127.0.0.1", device="cpu",
                             disaggregation_mode=mode, disaggregation_transfer_backend="kvferry",
                             disaggregation_bootstrap_port=port)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    get_parallel().override_permanently(pp_group=None)
    meta = MetadataBuffers(2 * args.concurrency, hidden_size=16, hidden_states_dtype=torch.float32,
                           max_sampling_mask_tokens=4)
    backend = TransferBackend("kvferry")
    a = get_kv_class(backend, KVClassType.KVARGS)()
    a.engine_rank = a.pp_rank = a.system_dp_rank = 0
    a.rust_http_port = a.kv_layout = a.ib_device = None
    a.kv_cache_dtype_str = "auto"
    a.kv_data_ptrs = [kv[b].ctypes.data for b in range(BUFFERS)]
    a.kv_data_lens = [kv[b].nbytes for b in range(BUFFERS)]
    a.kv_item_lens = [args.page_bytes] * BUFFERS
    a.page_size = 1
    # One KV head a page (what the tests' ranks declare): no model config to read the count from.
    a.kv_head_num = a.total_kv_head_num = 1
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = meta.get_buf_infos()
    a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    if mode == "prefill":
        get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    disagg = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE
    mgr = get_kv_class(backend, KVClassType.MANAGER)(a, disagg, server_args, False)
    side = KVClassType.SENDER if mode == "prefill" else KVClassType.RECEIVER
    return mgr, get_kv_class(backend, side), meta


def prefill(port, ready):
    from sglang.srt.disaggregation.base.conn import KVPoll

    kv = pool(True)
    mgr, sender_class, _meta = rank("prefill", port, kv)
    ready.set()
    addr = f"127.0.0.1:{port}"
    src = np.arange(args.pages_per_room, dtype=np.int32)
    live = {}
    next_room = 1
    while next_room <= args.rooms or live:
        while len(live) < 2 * args.concurrency and next_room <= args.rooms:
            live[next_room] = (sender_class(mgr, addr, next_room), False)
            next_room += 1
        for room, (s, sent) in list(live.items()):
            state = s.poll()
            if state == KVPoll.WaitingForInput and not sent:
                s.init(args.pages_per_room, room % (2 * args.concurrency))  # one per live room
                s.send(src)
                live[room] = (s, True)
            elif state in (KVPoll.Success, KVPoll.Failed):
                if state == KVPoll.Failed:
                    print(f"prefill: room {room} failed", file=sys.stderr)
                s.clear()
                del live[room]
        time.sleep(0.0002)


def main():
    from sglang.srt.disaggregation.base.conn import KVPoll

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=prefill, args=(port, ready), daemon=True)
    proc.start()
    ready.wait(120)
    kv = pool(False)
    want = pool(True)[:, : args.pages_per_room, :]
    mgr, receiver_class, _meta = rank("decode", port, kv)
    addr = f"127.0.0.1:{port}"
    while not mgr.try_ensure_parallel_info(addr):
        time.sleep(0.05)
    slots = [np.arange(i * args.pages_per_room, (i + 1) * args.pages_per_room, dtype=np.int32)
             for i in range(args.concurrency)]
    ok = bad = failed = 0
    started = time.perf_counter()
    for first in range(1, args.rooms + 1, args.concurrency):
        batch = list(range(first, min(first + args.concurrency, args.rooms + 1)))
        receivers = []
        for room in batch:
            r = receiver_class(mgr, addr, room)
            r.init(0)
            receivers.append(r)
        pending = dict(enumerate(receivers))
        granted = set()
        while pending:
            for i, r in list(pending.items()):
                state = r.poll()
                if state == KVPoll.WaitingForInput and i not in granted:
                    r.send_metadata(slots[i], i)
                    granted.add(i)
                elif state == KVPoll.Success:
                    same = np.array_equal(kv[:, slots[i], :], want)
                    ok += same
                    bad += not same
                    r.clear()
                    del pending[i]
                elif state == KVPoll.Failed:
                    failed += 1
                    r.clear()
                    del pending[i]
            time.sleep(0.0002)
    elapsed = time.perf_counter() - started
    moved = ok * BUFFERS * args.pages_per_room * args.page_bytes
    print(f"sglang backend: {ok} rooms verified, {bad} corrupted, {failed} failed, "
          f"{args.rooms / elapsed:.0f} rooms/s, {moved / elapsed / 1e9:.3f} GB/s, {elapsed:.2f} s")
    mgr.teardown()
    os._exit(0 if bad == failed == 0 else 1)


if __name__ == "__main__":
    main()
