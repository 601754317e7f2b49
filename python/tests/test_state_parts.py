"""A recurrent layer's state split by TP rank (``extra_parts``): two prefill ranks each hold
their share of every state item (per conv row their query, key and value channels, then
their SSM heads) and one decode rank at TP 1 receives both shares into its whole items, and
two decode ranks each receive their share from one prefill rank; every byte checked. Parts
that do not fit their item are refused when the node is made."""

import threading
import time

import numpy as np
import pytest

import kvferry
from kvferry import KVPoll

HEADS, HEAD_BYTES, PAGES, ITEMS = 4, 64, 8, 6
ROWS, KEY, VALUE, SSM_HEADS, SSM_HEAD_BYTES = 3, 8, 16, 4, 32
TOKEN = b"pytest-state-parts"
ROOM, SRC_PAGES, DST_PAGES, SRC_ITEM, DST_ITEM = 7, [0, 1], [5, 2], 1, 4
keep = []


def state_layout(tp, rank):
    """``(item bytes, parts)`` of a rank's state item: 3 conv rows of its query, key and
    value channels (1 byte each), then its SSM heads, then 16 bytes of padding."""
    k, v, h = KEY // tp, VALUE // tp, SSM_HEADS // tp
    row = 2 * k + v
    parts = [(0, ROWS, row, KEY, rank * k, k, 1), (k, ROWS, row, KEY, rank * k, k, 1),
             (2 * k, ROWS, row, VALUE, rank * v, v, 1),
             (ROWS * row, 1, 0, SSM_HEADS, rank * h, h, SSM_HEAD_BYTES)]
    return ROWS * row + h * SSM_HEAD_BYTES + 16, parts


def whole_state(item):
    """The model's state of logical item ``item``: conv rows of 32 channels, then 4 heads."""
    conv = (np.arange(ROWS * (2 * KEY + VALUE)).reshape(ROWS, -1) * 3 + item * 41) % 251
    ssm = (np.arange(SSM_HEADS * SSM_HEAD_BYTES) * 7 + item * 13 + 5) % 253
    return conv.astype(np.uint8), ssm.astype(np.uint8)


def share(item, tp, rank):
    """Rank ``rank``'s bytes of logical item ``item`` at TP ``tp`` (padding zero)."""
    conv, ssm = whole_state(item)
    k, v, h = KEY // tp, VALUE // tp, SSM_HEADS // tp
    rows = np.concatenate([conv[:, rank * k:(rank + 1) * k], conv[:, KEY + rank * k:KEY + (rank + 1) * k],
                           conv[:, 2 * KEY + rank * v:2 * KEY + (rank + 1) * v]], axis=1)
    size, _ = state_layout(tp, rank)
    out = np.zeros(size, np.uint8)
    body = np.concatenate([rows.reshape(-1), ssm[rank * h * SSM_HEAD_BYTES:(rank + 1) * h * SSM_HEAD_BYTES]])
    out[:body.size] = body
    return out


def node(role, tp, rank, fill):
    per = HEADS // tp
    heads = (HEADS, rank * per, per, HEAD_BYTES)
    layout = dict(layers=1, planes=1, page_bytes=per * HEAD_BYTES, pages=PAGES)
    kv = np.zeros((PAGES, per, HEAD_BYTES), np.uint8)
    item, parts = state_layout(tp, rank)
    state = np.zeros((ITEMS, item), np.uint8)
    if fill:
        for h in range(per):
            kv[:, h] = (np.arange(PAGES).reshape(-1, 1) * 17 + (rank * per + h) * 29 + np.arange(HEAD_BYTES)) % 249
        state[SRC_ITEM] = share(0, tp, rank)
    keep.extend([kv, state])
    n = kvferry.Node(role, layout, [(kv.ctypes.data, kv.nbytes)], token=TOKEN, heads=heads, rank=rank,
                     extras=[[(state.ctypes.data, state.nbytes, item)]], extra_parts=[[parts]])
    return n, kv, state


def serve(n, stop):
    while not stop.is_set():
        a = n.next_announcement(timeout=0.05)
        if a is not None:
            n.open_sender(a[0], a[1])
            n.send_chunk(a[0], SRC_PAGES, last=True, extras=[[SRC_ITEM]])


def move(p_tp, d_tp):
    """Moves the room from ``p_tp`` prefill ranks to ``d_tp`` decode ranks; returns each
    decode rank's state tensor once its room succeeded."""
    prefills = [node("prefill", p_tp, r, True)[0] for r in range(p_tp)]
    addrs = [p.listen("127.0.0.1:0")[0] for p in prefills]
    stop = threading.Event()
    servers = [threading.Thread(target=serve, args=(p, stop)) for p in prefills]
    for s in servers:
        s.start()
    decodes = []
    try:
        for rank in range(d_tp):
            d, _kv, state = node("decode", d_tp, rank, False)
            decodes.append((d, state))
            mine = [a for i, a in enumerate(addrs) if d_tp >= p_tp and i == rank * p_tp // d_tp
                    or d_tp < p_tp and i // (p_tp // d_tp) == rank]
            peers = [d.connect([a]) for a in mine]
            d.open_receiver(ROOM, peers, DST_PAGES, receivers=max(1, d_tp // p_tp), extras=[[DST_ITEM]])
        deadline = time.monotonic() + 20
        for d, _state in decodes:
            while d.poll(ROOM) != KVPoll.Success:
                assert d.poll(ROOM) != KVPoll.Failed, d.failure(ROOM)
                assert time.monotonic() < deadline, "the room did not succeed"
                time.sleep(0.005)
        return [state for _d, state in decodes]
    finally:
        stop.set()
        for s in servers:
            s.join()
        for n in [d for d, _s in decodes] + prefills:
            n.shutdown()


def test_two_prefill_ranks_fill_one_decode_ranks_state_items_with_every_byte_right():
    (state,) = move(2, 1)
    assert np.array_equal(state[DST_ITEM], share(0, 1, 0))
    assert not state[[i for i in range(ITEMS) if i != DST_ITEM]].any()


def test_one_prefill_rank_gives_two_decode_ranks_their_share_of_the_state():
    for rank, state in enumerate(move(1, 2)):
        assert np.array_equal(state[DST_ITEM], share(0, 2, rank)), f"decode rank {rank}"


def test_parts_outside_their_item_are_refused_naming_them():
    item, parts = state_layout(1, 0)
    state = np.zeros((ITEMS, item), np.uint8)
    kv = np.zeros((PAGES, HEADS, HEAD_BYTES), np.uint8)
    layout = dict(layers=1, planes=1, page_bytes=HEADS * HEAD_BYTES, pages=PAGES)
    bad = parts[:3] + [(item - 8, 1, 0, SSM_HEADS, 0, SSM_HEADS, SSM_HEAD_BYTES)]
    with pytest.raises(kvferry.InvalidArgument, match="extra_parts pool 0 tensor 0"):
        kvferry.Node("decode", layout, [(kv.ctypes.data, kv.nbytes)], token=TOKEN,
                     extras=[[(state.ctypes.data, state.nbytes, item)]], extra_parts=[[bad]])
    with pytest.raises(kvferry.InvalidArgument, match="extra_parts pool 0: 2 tensors"):
        kvferry.Node("decode", layout, [(kv.ctypes.data, kv.nbytes)], token=TOKEN,
                     extras=[[(state.ctypes.data, state.nbytes, item)]], extra_parts=[[parts, parts]])


def test_a_gdn_state_splits_into_each_projections_channels_per_kernel_row_then_its_heads():
    from kvferry._vllm_groups import StateSpec

    # TP 2, rank 1 of vLLM's default "SD" layout: 3 kernel rows of 8 query, 8 key and 16
    # value channels (2 bytes), then 2 value heads of (8, 8) float32.
    spec = StateSpec("GDN_ATTN", ((3, 32), (2, 8, 8)), (2, 4))
    assert spec.splits(2)
    assert spec.model_shapes(2) == ((3, 64), (4, 8, 8))
    assert spec.parts(2, 1) == [(0, 3, 64, 16, 8, 8, 2), (16, 3, 64, 16, 8, 8, 2),
                                (32, 3, 64, 32, 16, 16, 2), (192, 1, 0, 4, 2, 2, 256)]
    # Channel-major ("DS"): each projection's channels are one run of whole kernel rows.
    ds = StateSpec("GDN_ATTN", ((32, 3), (2, 8, 8)), (2, 4), dim_first=True)
    assert ds.parts(2, 1)[:3] == [(0, 1, 0, 16, 8, 8, 6), (48, 1, 0, 16, 8, 8, 6), (96, 1, 0, 32, 16, 16, 6)]


def test_a_state_whose_channels_split_two_ways_is_not_split():
    from kvferry._vllm_groups import StateSpec

    # 2 heads of (4, 6): 8 or 12 value channels, the other 28 split into query and key under
    # both readings: which one holds is unknown, so the state moves whole.
    assert not StateSpec("GDN_ATTN", ((3, 28), (2, 4, 6)), (2, 4)).splits(2)
    # 1 head of (4, 5): only 4 value channels leave an even query and key split.
    one = StateSpec("GDN_ATTN", ((3, 30), (1, 4, 5)), (2, 4))
    assert one.splits(2) and one.parts(2, 0)[:3] == [(0, 3, 60, 26, 0, 13, 2), (26, 3, 60, 26, 0, 13, 2),
                                                      (52, 3, 60, 8, 0, 4, 2)]
    assert not StateSpec("MAMBA2", ((3, 40), (2, 8, 8)), (2, 4)).splits(2)
    assert StateSpec("MAMBA2", ((3, 40), (2, 8, 8)), (2, 4), replicated=True).splits(2)


def test_a_mamba2_state_splits_only_where_its_groups_divide_over_the_ranks():
    from kvferry._vllm_groups import StateSpec

    # TP 2, rank 1: conv rows of 16 x, 16 B and 16 C channels (2 heads of 8, 4 groups of 8
    # over 2 ranks), then 2 heads of (8, 8) float32.
    spec = StateSpec("MAMBA2", ((3, 48), (2, 8, 8)), (2, 4), groups=4)
    assert spec.splits(2)
    assert spec.parts(2, 1) == [(0, 3, 96, 32, 16, 16, 2), (32, 3, 96, 32, 16, 16, 2),
                                (64, 3, 96, 32, 16, 16, 2), (288, 1, 0, 4, 2, 2, 256)]
    # 3 groups over 2 ranks: vLLM repeats one on both, so no rank's B is its own share.
    assert not StateSpec("MAMBA2", ((3, 48), (2, 8, 8)), (2, 4), groups=3).splits(2)
