"""Rooms per second and GB/s through the Python API, on the shape of a Rust demo run:

    python python/bench/rooms.py --rooms 2000 --concurrency 16
    kvferry demo --layers 8 --page-bytes 16384 --pages-per-room 4 --rooms 2000 --concurrency 16

A prefill process serves every room it is asked for; this process is the decode: it opens
`concurrency` rooms at a time on free pages, waits for each, checks every byte with numpy,
and reuses the pages once the room is releasable.
"""

import argparse
import multiprocessing as mp
import time

import numpy as np

import kvferry

p = argparse.ArgumentParser()
p.add_argument("--rooms", type=int, default=2000)
p.add_argument("--concurrency", type=int, default=16)
p.add_argument("--layers", type=int, default=8)
p.add_argument("--planes", type=int, default=2)
p.add_argument("--page-bytes", type=int, default=16384)
p.add_argument("--pages-per-room", type=int, default=4)
args = p.parse_args()

PAGES = args.concurrency * args.pages_per_room
LAYOUT = dict(layers=args.layers, planes=args.planes, page_bytes=args.page_bytes, pages=PAGES)
REGIONS = args.layers * args.planes


def pool(fill):
    kv = np.zeros((REGIONS, PAGES, args.page_bytes), dtype=np.uint8)
    if fill:
        for r in range(REGIONS):
            kv[r] = ((np.arange(PAGES * args.page_bytes) * (r + 3)) % 251).reshape(PAGES, -1)
    return kv


def spans(kv):
    return [(kv[r].ctypes.data, kv[r].nbytes) for r in range(REGIONS)]


def prefill(q, stop):
    kv = pool(True)
    n = kvferry.Node("prefill", LAYOUT, spans(kv), token=b"bench")
    q.put(n.listen("127.0.0.1:0")[0])
    src = list(range(args.pages_per_room))
    while not stop.is_set():
        a = n.next_announcement(timeout=0.1)
        if a is None:
            continue
        n.open_sender(a[0], a[1])
        n.send_chunk(a[0], src, last=True)
        n.forget(a[0])
    n.shutdown()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=prefill, args=(q, stop))
    proc.start()
    addr = q.get(timeout=30)
    want = pool(True)[:, : args.pages_per_room, :]
    kv = pool(False)
    d = kvferry.Node("decode", LAYOUT, spans(kv), token=b"bench")
    peer = d.connect([addr])
    slots = [list(range(i * args.pages_per_room, (i + 1) * args.pages_per_room)) for i in range(args.concurrency)]
    started = time.perf_counter()
    ok = bad = 0
    for first in range(0, args.rooms, args.concurrency):
        batch = list(range(first, min(first + args.concurrency, args.rooms)))
        for i, room in enumerate(batch):
            d.open_receiver(room + 1, [peer], pages=slots[i])
        for i, room in enumerate(batch):
            if d.wait(room + 1, 30.0) == kvferry.KVPoll.Success:
                ok += np.array_equal(kv[:, slots[i], :], want)
                bad += not np.array_equal(kv[:, slots[i], :], want)
            while not d.releasable(room + 1):
                time.sleep(0.0005)
            d.forget(room + 1)
    elapsed = time.perf_counter() - started
    moved = ok * REGIONS * args.pages_per_room * args.page_bytes
    print(f"python: {ok} rooms verified, {bad} corrupted, {args.rooms / elapsed:.0f} rooms/s, "
          f"{moved / elapsed / 1e9:.3f} GB/s, {elapsed:.2f} s")
    d.shutdown()
    stop.set()
    proc.join()
