"""The end-to-end checksum from Python: a knob like any other (`checksum=True`), rooms move
under it, and nodes that disagree on it are refused naming the setting."""

import numpy as np
import pytest

import kvferry
from kvferry import KVPoll

LAYOUT = dict(layers=2, planes=2, page_bytes=1024, pages=8, aux_bytes=16, slots=4)
REGIONS = LAYOUT["layers"] * LAYOUT["planes"]


def node(role, fill, **config):
    kv = np.zeros((REGIONS, LAYOUT["pages"], LAYOUT["page_bytes"]), dtype=np.uint8)
    if fill:
        kv[:] = np.arange(LAYOUT["page_bytes"], dtype=np.uint8)
    aux = np.zeros((LAYOUT["slots"], LAYOUT["aux_bytes"]), dtype=np.uint8)
    spans = [(kv[r].ctypes.data, kv[r].nbytes) for r in range(REGIONS)]
    n = kvferry.Node(role, LAYOUT, spans, aux=(aux.ctypes.data, aux.nbytes), token=b"t", **config)
    return n, kv


def test_a_room_moves_with_the_checksum_on():
    p, src = node("prefill", True, checksum=True)
    d, dst = node("decode", False, checksum=True)
    peer = d.connect([p.listen("127.0.0.1:0")[0]])
    d.open_receiver(1, [peer], pages=[4, 5], aux_slot=0)
    room, generation, _, _ = p.next_announcement(timeout=10.0)
    p.open_sender(room, generation)
    p.send_chunk(room, [0, 1], last=True, aux_slot=1)
    assert d.wait(1, 20.0) == KVPoll.Success
    assert np.array_equal(dst[:, 4:6, :], src[:, 0:2, :])
    p.shutdown()
    d.shutdown()


def test_nodes_that_disagree_on_the_checksum_are_refused_naming_it():
    p, _ = node("prefill", True, checksum=True)
    d, _ = node("decode", False)
    with pytest.raises(kvferry.PeerRefused, match="checksum differs") as refused:
        d.connect([p.listen("127.0.0.1:0")[0]])
    assert refused.value.args[0] == "incompatible_peer"
    assert isinstance(refused.value, kvferry.ConnectError)
    p.shutdown()
    d.shutdown()


def test_a_checksum_value_that_is_not_a_switch_is_refused():
    with pytest.raises(kvferry.InvalidArgument, match="KVFERRY_CHECKSUM"):
        node("decode", False, checksum="maybe")
