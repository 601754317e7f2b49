"""Rooms per second and GB/s when prefill and decode split the model's KV heads over
different attention TP sizes, against the same TP on both sides, one sitting, same bytes:

    python python/bench/heads.py --rooms 1000

Each rank is a process with its own kvferry.Node over a pool laid out as SGLang's MHA pools
are (a page is `page_tokens` token rows of the rank's heads). Every room carries the whole
model's KV for `pages_per_room` pages, whatever the split: with prefill TP 2 -> decode TP 1
each prefill rank sends half of every token row, with TP 1 -> TP 2 each decode rank receives
half. The decode ranks open `concurrency` rooms at a time and reuse pages once releasable;
the last room's bytes are checked on every decode rank. With `--state`, every room also
carries a GDN layer's recurrent state per layer (3 conv rows of query, key and value
channels, then SSM heads), split by TP rank: each rank holds its share, and between
different TP sizes each decode rank's share comes from the prefill ranks holding parts of it.
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
p.add_argument("--state", action="store_true", help="a split GDN state item per layer in every room")
p.add_argument("--state-key", type=int, default=256, help="query (and key) conv channels, 2 bytes each")
p.add_argument("--state-value", type=int, default=512, help="value conv channels, 2 bytes each")
p.add_argument("--state-heads", type=int, default=8, help="SSM heads")
p.add_argument("--state-head-bytes", type=int, default=16384, help="bytes of one SSM head")
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


ROWS, ELEM = 3, 2


def state_parts(tp, rank):
    """``(item bytes, parts)`` of a rank's GDN state item (``Node(extra_parts=)``)."""
    k, v, h = args.state_key // tp, args.state_value // tp, args.state_heads // tp
    row = (2 * k + v) * ELEM
    parts = [(0, ROWS, row, args.state_key, rank * k, k, ELEM),
             (k * ELEM, ROWS, row, args.state_key, rank * k, k, ELEM),
             (2 * k * ELEM, ROWS, row, args.state_value, rank * v, v, ELEM),
             (ROWS * row, 1, 0, args.state_heads, rank * h, h, args.state_head_bytes)]
    return ROWS * row + h * args.state_head_bytes, parts


def state_share(layer, tp, rank):
    """Rank ``rank``'s bytes of layer ``layer``'s state, its share of the model's."""
    channels = 2 * args.state_key + args.state_value
    conv = ((np.arange(ROWS * channels * ELEM).reshape(ROWS, channels, ELEM) + layer * 5) % 251).astype(np.uint8)
    ssm = ((np.arange(args.state_heads * args.state_head_bytes).reshape(args.state_heads, -1) * 3 + layer)
           % 253).astype(np.uint8)
    k, v, h = args.state_key // tp, args.state_value // tp, args.state_heads // tp
    key = args.state_key
    rows = np.concatenate([conv[:, rank * k:(rank + 1) * k], conv[:, key + rank * k:key + (rank + 1) * k],
                           conv[:, 2 * key + rank * v:2 * key + (rank + 1) * v]], axis=1)
    return np.concatenate([rows.reshape(-1), ssm[rank * h:(rank + 1) * h].reshape(-1)])


def state_pool(tp, rank, fill):
    """A rank's state: per layer, `concurrency` items (the prefill fills item 0), with the
    pool and parts ``Node`` takes."""
    if not args.state:
        return None, {}
    item, parts = state_parts(tp, rank)
    st = np.zeros((args.layers, args.concurrency, item), np.uint8)
    if fill:
        for layer in range(args.layers):
            st[layer, 0] = state_share(layer, tp, rank)
    pool = [(st[layer].ctypes.data, st[layer].nbytes, item) for layer in range(args.layers)]
    return st, dict(extras=[pool], extra_parts=[[parts] * args.layers])


def spans(kv):
    return [(kv[r].ctypes.data, kv[r].nbytes) for r in range(kv.shape[0])]


def prefill(tp, rank, q, stop):
    import kvferry

    kv, heads, layout = pool(tp, rank, True)
    _states, state = state_pool(tp, rank, True)
    n = kvferry.Node("prefill", layout, spans(kv), token=b"bench", heads=heads, rank=rank,
                     transport=args.transport, checksum=args.checksum, **state)
    items = [[0]] if args.state else []
    q.put((rank, n.listen("127.0.0.1:0")[0]))
    src = list(range(args.pages_per_room))
    while not stop.is_set():
        a = n.next_announcement(timeout=0.1)
        if a is None:
            continue
        n.open_sender(a[0], a[1])
        n.send_chunk(a[0], src, last=True, extras=items)
        n.forget(a[0])
    n.shutdown()


def decode(p_tp, tp, rank, addrs, start, out):
    import kvferry

    kv, heads, layout = pool(tp, rank, False)
    states, state = state_pool(tp, rank, False)
    n = kvferry.Node("decode", layout, spans(kv), token=b"bench", heads=heads, rank=rank,
                     transport=args.transport, checksum=args.checksum, **state)
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
            n.open_receiver(room, peers, pages, receivers=receivers, extras=[[slot]] if args.state else [])
            live[room] = (slot, pages)
            opened += 1
        for room in list(live):
            st = n.poll(room)
            if st == 4:  # Success
                slot, pages = live.pop(room)
                last, last_slot = pages, slot
                n.forget(room)
                free.append(slot)
                done += 1
            elif st == 0:
                raise RuntimeError(f"room {room} failed: {n.failure(room)}")
        time.sleep(0.0002)
    took = time.perf_counter() - began
    want, _h, _l = pool(tp, rank, True)
    ok = all(np.array_equal(kv[:, d], want[:, s]) for s, d in zip(range(args.pages_per_room), last))
    moved = kv[:, :args.pages_per_room].nbytes
    if states is not None:
        ok = ok and all(np.array_equal(states[layer, last_slot], state_share(layer, tp, rank))
                        for layer in range(args.layers))
        moved += states[:, 0].nbytes
    n.shutdown()
    out.put((took, moved * args.rooms, ok))


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
    if args.state:
        room_bytes += args.layers * state_parts(1, 0)[0]
    print(f"{args.rooms} rooms of {room_bytes / 1024:.0f} KiB (the whole model's KV of "
          f"{args.pages_per_room} pages{', and its split state' if args.state else ''}), "
          f"{args.concurrency} in flight, "
          f"transport {args.transport or 'the default'}, checksum {'on' if args.checksum else 'off'}")
    base = None
    for pair in args.pairs.split(","):
        p_tp, d_tp = (int(x) for x in pair.split(":"))
        rate, gbs, ok = run(p_tp, d_tp)
        base = base or rate
        print(f"prefill TP {p_tp} -> decode TP {d_tp}: {rate:8.0f} rooms/s {gbs:6.2f} GB/s "
              f"({rate / base:.2f}x of the first) bytes {'ok' if ok else 'WRONG'}")
