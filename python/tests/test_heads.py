"""Prefill and decode at different attention TP sizes on one host: a decode rank receives its
KV heads from two prefill ranks (each writes its half of every token row), every byte checked.
Over the same-host path, rows that lie apart in the decode's pages and are too short to copy
well by cross-memory attach go over the session's TCP connections instead."""

import threading
import time

import numpy as np

import kvferry
from kvferry import KVPoll

LAYERS, HEADS, HEAD_BYTES, PAGE_TOKENS, PAGES = 2, 8, 256, 16, 8
TOKEN = b"pytest-heads"


def pool(tp, rank, fill):
    """A rank's KV pool as SGLang's MHA pool lays it out: a page is `PAGE_TOKENS` token rows
    of the rank's heads."""
    per = HEADS // tp
    heads = (HEADS, rank * per, per, HEAD_BYTES)
    layout = dict(layers=LAYERS, planes=2, page_bytes=PAGE_TOKENS * per * HEAD_BYTES, pages=PAGES)
    kv = np.zeros((2 * LAYERS, PAGES, PAGE_TOKENS, per, HEAD_BYTES), np.uint8)
    if fill:
        h = np.arange(heads[1], heads[1] + per).reshape(1, 1, 1, -1, 1)
        r = np.arange(2 * LAYERS).reshape(-1, 1, 1, 1, 1)
        pg = np.arange(PAGES).reshape(1, -1, 1, 1, 1)
        t = np.arange(PAGE_TOKENS).reshape(1, 1, -1, 1, 1)
        kv[:] = (r * 7 + pg * 3 + h * 11 + t * 5) % 251
    spans = [(kv[i].ctypes.data, kv[i].nbytes) for i in range(kv.shape[0])]
    return kv, heads, layout, spans


def serve(n, stop):
    while not stop.is_set():
        a = n.next_announcement(timeout=0.05)
        if a is None:
            continue
        n.open_sender(a[0], a[1])
        n.send_chunk(a[0], [0, 1, 2, 3], last=True)


def test_two_prefill_ranks_fill_one_decode_ranks_rows_with_every_byte_right():
    kvs, prefills = [], []
    for rank in range(2):
        kv, heads, layout, spans = pool(2, rank, True)
        kvs.append(kv)
        prefills.append(kvferry.Node("prefill", layout, spans, token=TOKEN, heads=heads, rank=rank))
    addrs = [p.listen("127.0.0.1:0")[0] for p in prefills]
    stop = threading.Event()
    servers = [threading.Thread(target=serve, args=(p, stop)) for p in prefills]
    for s in servers:
        s.start()
    kv, heads, layout, spans = pool(1, 0, False)
    d = kvferry.Node("decode", layout, spans, token=TOKEN, heads=heads)
    try:
        peers = [d.connect([a]) for a in addrs]
        rooms = {1: [4, 5, 6, 7], 2: [0, 1, 2, 3]}
        for room, pages in rooms.items():
            d.open_receiver(room, peers, pages)
        deadline = time.monotonic() + 20
        while any(d.poll(r) != KVPoll.Success for r in rooms):
            assert all(d.poll(r) != KVPoll.Failed for r in rooms), [d.failure(r) for r in rooms]
            assert time.monotonic() < deadline, "rooms did not succeed"
            time.sleep(0.005)
        for pages in rooms.values():
            for src, dst in enumerate(pages):
                # Decode token rows hold rank 0's four heads, then rank 1's.
                want = np.concatenate([k[:, src] for k in kvs], axis=2)
                assert np.array_equal(kv[:, dst], want), f"page {dst}"
        paths = {path for _s, path in d.session_paths()}
        if paths == {"cma"}:
            # The rows (1 KiB each, 2 KiB apart in the decode's pages) came over TCP: this
            # node applied them itself.
            assert d.counters()["writes_applied"] > 0
    finally:
        stop.set()
        for s in servers:
            s.join()
        d.shutdown()
        for p in prefills:
            p.shutdown()
