"""Prefill and decode at different attention TP sizes on one host, every byte checked: a
decode rank receives its KV heads from two prefill ranks (each writes its half of every token
row), and two decode ranks each receive their half of one prefill rank's rows. Over the
same-host path, rows that lie apart in the decode's pages and are too short to copy well by
cross-memory attach go over the session's TCP connections instead; rows side by side in the
decode's pages are copied."""

import os
import threading
import time

import numpy as np
import pytest

import kvferry
from kvferry import KVPoll

LAYERS, HEADS, HEAD_BYTES, PAGE_TOKENS, PAGES = 2, 8, 256, 16, 8
TOKEN = b"pytest-heads"
ROOMS = {1: [4, 5, 6, 7], 2: [0, 1, 2, 3]}
# The prefill ranks' pools, alive as long as their nodes may read them.
prefills_keep = []


def pool(tp, rank, fill):
    """A rank's KV pool as SGLang's MHA pool lays it out: a page is `PAGE_TOKENS` token rows
    of the rank's heads."""
    per = HEADS // tp
    heads = (HEADS, rank * per, per, HEAD_BYTES)
    layout = dict(layers=LAYERS, planes=2, page_bytes=PAGE_TOKENS * per * HEAD_BYTES, pages=PAGES)
    kv = np.zeros((2 * LAYERS, PAGES, PAGE_TOKENS, per, HEAD_BYTES), np.uint8)
    if fill:
        kv[:] = expected(heads[1], per)
    spans = [(kv[i].ctypes.data, kv[i].nbytes) for i in range(kv.shape[0])]
    return kv, heads, layout, spans


def expected(first, count):
    """What every byte of heads `first..first + count` holds at the source (page, token,
    head and byte all change it)."""
    h = np.arange(first, first + count).reshape(1, 1, 1, -1, 1)
    r = np.arange(2 * LAYERS).reshape(-1, 1, 1, 1, 1)
    pg = np.arange(PAGES).reshape(1, -1, 1, 1, 1)
    t = np.arange(PAGE_TOKENS).reshape(1, 1, -1, 1, 1)
    b = np.arange(HEAD_BYTES).reshape(1, 1, 1, 1, -1)
    return ((r * 7 + pg * 3 + h * 11 + t * 5 + b * 13) % 251).astype(np.uint8)


def serve(n, stop):
    while not stop.is_set():
        a = n.next_announcement(timeout=0.05)
        if a is None:
            continue
        n.open_sender(a[0], a[1])
        n.send_chunk(a[0], [0, 1, 2, 3], last=True)


def move(p_tp, d_tp):
    """Moves `ROOMS` from `p_tp` prefill ranks to `d_tp` decode ranks over `transport="auto"`;
    returns the prefill nodes, per decode rank its node, its pool and its heads (both sides'
    nodes still running), and whether every decode session took the same-host path before
    its rooms opened."""
    prefills, decodes = [], []
    try:
        return prefills, decodes, open_and_move(p_tp, d_tp, prefills, decodes)
    except BaseException:
        shutdown([d for d, _kv, _heads in decodes] + prefills)
        raise


def open_and_move(p_tp, d_tp, prefills, decodes):
    same_host = True
    for rank in range(p_tp):
        kv, heads, layout, spans = pool(p_tp, rank, True)
        prefills_keep.append(kv)
        prefills.append(kvferry.Node("prefill", layout, spans, token=TOKEN, heads=heads,
                                     rank=rank, transport="auto"))
    addrs = [p.listen("127.0.0.1:0")[0] for p in prefills]
    stop = threading.Event()
    servers = [threading.Thread(target=serve, args=(p, stop)) for p in prefills]
    for s in servers:
        s.start()
    try:
        for rank in range(d_tp):
            kv, heads, layout, spans = pool(d_tp, rank, False)
            d = kvferry.Node("decode", layout, spans, token=TOKEN, heads=heads, rank=rank,
                             transport="auto")
            lo, hi = heads[1], heads[1] + heads[2]
            decodes.append((d, kv, (lo, hi)))
            per_p = HEADS // p_tp
            mine = [a for i, a in enumerate(addrs) if i * per_p < hi and lo < (i + 1) * per_p]
            peers = [d.connect([a]) for a in mine]
            # Where the same-host path can be taken, the rooms start once it was: what goes
            # before its Accept travels over TCP.
            until = time.monotonic() + 3
            while paths(d) != {"cma"} and time.monotonic() < until:
                time.sleep(0.005)
            same_host &= paths(d) == {"cma"}
            for room, pages in ROOMS.items():
                d.open_receiver(room, peers, pages, receivers=max(1, d_tp // p_tp))
        deadline = time.monotonic() + 20
        for d, _kv, _heads in decodes:
            while any(d.poll(r) != KVPoll.Success for r in ROOMS):
                assert all(d.poll(r) != KVPoll.Failed for r in ROOMS), [d.failure(r) for r in ROOMS]
                assert time.monotonic() < deadline, "rooms did not succeed"
                time.sleep(0.005)
    finally:
        stop.set()
        for s in servers:
            s.join()
    return same_host


def rdma_devices():
    """Whether this host has RDMA devices: `auto` sessions then also make queue pairs, open no
    TCP data connections, and copy every row on the same-host path."""
    return os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))


def paths(node):
    return {path for _s, path in node.session_paths()}


def check_bytes(decodes):
    for _d, kv, (lo, hi) in decodes:
        for pages in ROOMS.values():
            for src, dst in enumerate(pages):
                want = expected(lo, hi - lo)[:, src]
                assert np.array_equal(kv[:, dst], want), f"heads {lo}..{hi}, page {dst}"


def shutdown(nodes):
    for n in nodes:
        n.shutdown()


def test_two_prefill_ranks_fill_one_decode_ranks_rows_with_every_byte_right():
    prefills, decodes, same_host = move(2, 1)
    try:
        check_bytes(decodes)
        ((d, _kv, _heads),) = decodes
        if same_host and not rdma_devices():
            # Each prefill rank's rows (1 KiB, 2 KiB apart in the decode's pages) came over
            # TCP: this node applied every operation itself.
            planned = sum(p.counters()["ops_planned"] for p in prefills)
            assert d.counters()["writes_applied"] == planned
    finally:
        shutdown([d for d, _kv, _heads in decodes] + prefills)
    if not same_host:
        pytest.skip("bytes checked; the same-host path was not taken on this host")


def test_one_prefill_rank_fills_two_decode_ranks_halves_with_every_byte_right():
    prefills, decodes, same_host = move(1, 2)
    try:
        check_bytes(decodes)
        for d, _kv, _heads in decodes:
            if same_host:
                # A decode rank's half of every row lies side by side in its own pages: the
                # prefill copied it, this node applied nothing itself.
                assert d.counters()["writes_applied"] == 0
    finally:
        shutdown([d for d, _kv, _heads in decodes] + prefills)
    if not same_host:
        pytest.skip("bytes checked; the same-host path was not taken on this host")
