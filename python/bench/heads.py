"""Rooms per second and GB/s when prefill and decode split the model's KV heads over
different attention TP sizes, against the same TP on both sides, one sitting, same bytes:

    python python/bench/heads.py --rooms 1000

Each rank is a process with its own kvferry.Node over a pool laid out as SGLang's MHA pools
are (a page is `page_tokens` token rows of the rank's heads). Every room carries the whole
model's KV for `pages_per_room` pages, whatever the split: with prefill TP 2 -> decode TP 1
each prefill rank sends half of every token row, with TP 1 -> TP 2 each decode rank receives
half. The decode ranks open `concurrency` rooms at a time and reuse pages once releasable;
the last room's bytes are checked on every decode rank.
"""

import argparse
import multiprocessing as mp
import time

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--rooms", type=int, default=1000)
p.add_argument("--concurrency", type=int, default=16)
p.add_argument("--layers", type=int, default=8)
p.add_argument("--heads", type=int, default=8)
p.add_argument("--head-bytes", type=int, default=256)
p.add_argument("--page-tokens", type=int, default=16)
p.add_argument("--pages-per-room", type=int, default=4)
p.add_argument("--pairs", default="1:1,2:1,1:2", help="prefill TP:decode TP, comma separated")
p.add_argument("--checksum", action="store_true", help="the end-to-end checksum on every node")
p.add_argument("--transport", default=None,
               help="the nodes' transport (tcp, same-host, auto); default: the node's own")
args = p.parse_args()

PAGES = args.concurrency * args.pages_per_room


def geometry(tp, rank):
    per = args.heads // tp
    heads = (args.heads, rank * per, per, args.head_bytes)
    page_bytes = args.page_tokens * per * args.head_bytes
    layout = dict(layers=args.layers, planes=2, page_bytes=page_bytes, pages=PAGES)
    return heads, layout, page_bytes


def pool(tp, rank, fill):
    heads, layout, page_bytes = geometry(tp, rank)
    kv = np.zeros((2 * args.layers, PAGES, args.page_tokens, heads[2], args.head_bytes), np.uint8)
    if fill:
        h = np.arange(heads[1], heads[1] + heads[2]).reshape(1, 1, 1, -1, 1)
        r = np.arange(2 * args.layers).reshape(-1, 1, 1, 1, 1)
        pg = np.arange(PAGES).reshape(1, -1, 1, 1, 1)
        kv[:] = (r * 7 + pg * 3 + h * 11) % 251
    return kv, heads, layout


def spans(kv):
    return [(kv[r].ctypes.data, kv[r].nbytes) for r in range(kv.shape[0])]


def prefill(tp, rank, q, stop):
    import kvferry

    kv, heads, layout = pool(tp, rank, True)
    n = kvferry.Node("prefill", layout, spans(kv), token=b"bench", heads=heads, rank=rank,
                     transport=args.transport, checksum=args.checksum)
    q.put((rank, n.listen("127.0.0.1:0")[0]))
    src = list(range(args.pages_per_room))
    while not stop.is_set():
        a = n.next_announcement(timeout=0.1)
        if a is None:
            continue
        n.open_sender(a[0], a[1])
        n.send_chunk(a[0], src, last=True)
        n.forget(a[0])
    n.shutdown()


def decode(p_tp, tp, rank, addrs, start, out):
    import kvferry

    kv, heads, layout = pool(tp, rank, False)
    n = kvferry.Node("decode", layout, spans(kv), token=b"bench", heads=heads, rank=rank,
                     transport=args.transport, checksum=args.checksum)
    # The prefill ranks holding some of this rank's heads, and how many decode ranks ask each.
    lo, hi = heads[1], heads[1] + heads[2]
    per_p = args.heads // p_tp
    mine = [a for i, a in enumerate(addrs) if i * per_p < hi and lo < (i + 1) * per_p]
    peers = [n.connect([a]) for a in mine]
    receivers = max(1, tp // p_tp)
    free = list(range(args.concurrency))
    live = {}
    start.wait()
    began = time.perf_counter()
    opened = done = 0
    while done < args.rooms:
        while free and opened < args.rooms:
            slot = free.pop()
            room = opened + 1
            pages = list(range(slot * args.pages_per_room, (slot + 1) * args.pages_per_room))
            n.open_receiver(room, peers, pages, receivers=receivers)
            live[room] = (slot, pages)
            opened += 1
        for room in list(live):
            st = n.poll(room)
            if st == 4:  # Success
                slot, pages = live.pop(room)
                last = pages
                n.forget(room)
                free.append(slot)
                done += 1
            elif st == 0:
                raise RuntimeError(f"room {room} failed: {n.failure(room)}")
        time.sleep(0.0002)
    took = time.perf_counter() - began
    want, _h, _l = pool(tp, rank, True)
    ok = all(np.array_equal(kv[:, d], want[:, s]) for s, d in zip(range(args.pages_per_room), last))
    n.shutdown()
    out.put((took, kv[:, :args.pages_per_room].nbytes * args.rooms, ok))


def run(p_tp, d_tp):
    ctx = mp.get_context("spawn")
    q, stop, start, out = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=prefill, args=(p_tp, r, q, stop)) for r in range(p_tp)]
    for x in ps:
        x.start()
    addrs = [a for _r, a in sorted(q.get(timeout=60) for _ in ps)]
    ds = [ctx.Process(target=decode, args=(p_tp, d_tp, r, addrs, start, out)) for r in range(d_tp)]
    for x in ds:
        x.start()
    time.sleep(2)
    start.set()
    got = [out.get(timeout=600) for _ in ds]
    stop.set()
    for x in ps + ds:
        x.join(timeout=30)
    took = max(g[0] for g in got)
    moved = sum(g[1] for g in got)
    return args.rooms / took, moved / took / 1e9, all(g[2] for g in got)


if __name__ == "__main__":
    room_bytes = args.pages_per_room * args.page_tokens * args.heads * args.head_bytes * 2 * args.layers
    print(f"{args.rooms} rooms of {room_bytes / 1024:.0f} KiB (the whole model's KV of "
          f"{args.pages_per_room} pages), {args.concurrency} in flight, "
          f"transport {args.transport or 'the default'}, checksum {'on' if args.checksum else 'off'}")
    base = None
    for pair in args.pairs.split(","):
        p_tp, d_tp = (int(x) for x in pair.split(":"))
        rate, gbs, ok = run(p_tp, d_tp)
        base = base or rate
        print(f"prefill TP {p_tp} -> decode TP {d_tp}: {rate:8.0f} rooms/s {gbs:6.2f} GB/s "
              f"({rate / base:.2f}x of the first) bytes {'ok' if ok else 'WRONG'}")
