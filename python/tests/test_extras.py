"""Extra pools from Python: a hybrid model's state slots and window pages move with a room,
item for item into every tensor, and bad extra pools or items raise InvalidArgument."""

import numpy as np
import pytest

import kvferry
from kvferry import KVPoll

LAYOUT = dict(layers=2, planes=2, page_bytes=1024, pages=8, aux_bytes=16, slots=4)
REGIONS = LAYOUT["layers"] * LAYOUT["planes"]
TOKEN = b"pytest-token"
# Pool 0: state slots, two tensors of different item sizes. Pool 1: window pages.
SHAPES = [[(5, 40), (5, 96)], [(6, 256), (6, 256), (6, 256)]]


def pools(fill):
    out = []
    for p, tensors in enumerate(SHAPES):
        bufs = []
        for t, (items, item) in enumerate(tensors):
            b = np.zeros((items, item), dtype=np.uint8)
            if fill:
                for i in range(items):
                    b[i] = (np.arange(item) * (t + 1) + i * 13 + p * 61 + 1) % 251
            bufs.append(b)
        out.append(bufs)
    return out


def node(role, fill, extras=None):
    kv = np.zeros((REGIONS, LAYOUT["pages"], LAYOUT["page_bytes"]), dtype=np.uint8)
    aux = np.zeros((LAYOUT["slots"], LAYOUT["aux_bytes"]), dtype=np.uint8)
    if fill:
        kv[:] = 7
    state = pools(fill)
    spans = [[(b.ctypes.data, b.nbytes, b.shape[1]) for b in bufs] for bufs in state]
    n = kvferry.Node(
        role,
        LAYOUT,
        [(kv[r].ctypes.data, kv[r].nbytes) for r in range(REGIONS)],
        aux=(aux.ctypes.data, aux.nbytes),
        token=TOKEN,
        extras=spans if extras is None else extras,
    )
    return n, kv, state


def test_state_slots_and_window_pages_move_item_for_item():
    p, _pkv, src = node("prefill", fill=True)
    d, kv, dst = node("decode", fill=False)
    addr = p.listen("127.0.0.1:0")[0]
    peer = d.connect([addr])
    d.open_receiver(1, [peer], pages=[2, 3], aux_slot=0, extras=[[4], [0, 1, 5]])
    room, generation, _pages, _skip = p.next_announcement(timeout=10.0)
    p.open_sender(room, generation)
    p.send_chunk(room, [0, 1], last=True, aux_slot=1, extras=[[2], [3, 4, 0]])
    assert d.wait(1, 20.0) == KVPoll.Success
    assert (kv[:, 2:4, :] == 7).all()
    for t in range(2):
        assert np.array_equal(dst[0][t][4], src[0][t][2])
        # Nothing but the granted slot was written.
        assert not np.delete(dst[0][t], 4, axis=0).any()
    for t in range(3):
        for s, g in zip([3, 4, 0], [0, 1, 5]):
            assert np.array_equal(dst[1][t][g], src[1][t][s])
    p.shutdown()
    d.shutdown()


def test_bad_extra_pools_and_items_raise_invalid_argument():
    bufs = pools(False)
    uneven = [[(bufs[0][0].ctypes.data, bufs[0][0].nbytes, 40), (bufs[1][0].ctypes.data, 256, 256)]]
    with pytest.raises(kvferry.InvalidArgument, match="same number of items"):
        node("decode", fill=False, extras=uneven)
    with pytest.raises(kvferry.InvalidArgument, match="item_bytes"):
        node("decode", fill=False, extras=[[(bufs[0][0].ctypes.data, 200, 0)]])
    d, _kv, _dst = node("decode", fill=False)
    p, _pkv, _src = node("prefill", fill=True)
    peer = d.connect([p.listen("127.0.0.1:0")[0]])
    with pytest.raises(kvferry.InvalidArgument, match="extra pool 1"):
        d.open_receiver(2, [peer], pages=[1], aux_slot=0, extras=[[0], [6]])
    with pytest.raises(kvferry.InvalidArgument, match="extra pool 2"):
        d.open_receiver(3, [peer], pages=[1], aux_slot=0, extras=[[0], [1], [1]])
    p.shutdown()
    d.shutdown()


def test_a_peer_with_other_extra_pools_is_refused_naming_the_field_and_both_values():
    p, _pkv, _src = node("prefill", fill=True, extras=[])
    d, _kv, _dst = node("decode", fill=False)
    with pytest.raises(kvferry.ConnectError, match="extra_pools differs: this node has 0, the peer 2"):
        d.connect([p.listen("127.0.0.1:0")[0]])
    p.shutdown()
    d.shutdown()
