"""Hybrid models' state pools through SGLang 0.5.23's own classes, one process per rank:
Mamba's per-request state slot, the sliding-window KV pool (its own pages), the DSA
indexer's pages move with the room, every byte of every granted item checked against what
the prefill held; pools that differ between the sides, or that would need head slices, are
refused naming the field; state on a pipeline-parallel prefill is refused at start."""

import pytest
from sglang.srt.disaggregation.base.conn import KVPoll

import cluster
from cluster import Cluster
from test_layouts import assert_every_byte, layout, move

HYBRID = ("mamba", "swa", "dsa")
# (room, prefill pages, chunks, decode pages, aux slot), as in test_layouts.
ROOMS = [
    (61, [3, 4, 5, 6, 7], [2, 2, 1], [20, 21, 22, 23, 9], 1),
    (62, [9, 1], [2], [2, 15], 2),
]
# Per room, per pool: the prefill's items and the decode's (Mamba: one slot; SWA: the
# window's pages in its own pool; DSA: the indexer pages, the room's KV pages).
STATES = {
    61: ([[2], [10, 11], [3, 4, 5, 6, 7]], [[7], [0, 5], [20, 21, 22, 23, 9]]),
    62: ([[8], [3], [9, 1]], [[1], [11], [2, 15]]),
}


@pytest.fixture(scope="module")
def model():
    return cluster.model_dir()


def test_mamba_swa_and_dsa_state_move_with_the_room(model):
    c = Cluster(*layout(model, states=HYBRID))
    try:
        outcomes = move(c, rooms=ROOMS, states=STATES, flip_state=True)
        assert_every_byte(outcomes)
        flips = [r.get("flip_caught") for _s, rs in outcomes for r in rs]
        assert flips and all(flips), "the byte check must see one flipped state byte"
    finally:
        c.close()


def test_state_pools_go_to_their_dp_rank(model):
    c = Cluster(*layout(model, 1, 1, dp=2, states=("mamba", "swa")))
    try:
        rooms = [(64, [1, 2], [2], [5, 6], 1), (65, [3], [1], [7], 2)]
        states = {64: ([[1], [2, 3]], [[4], [8, 9]]), 65: ([[5], [6]], [[3], [1]])}
        outcomes = move(c, rooms=rooms, dp=2, states=states)
        assert_every_byte(outcomes)
        assert all(len(s) == 1 and len(r) == 1 for s, r in outcomes)
    finally:
        c.close()


def test_mla_indexer_pages_come_once_from_the_rank_that_sends(model):
    # MLA with DSA over prefill TP 2 into decode TP 1: one prefill rank sends the latent KV
    # and the indexer pages, the other only confirms.
    c = Cluster(*layout(model, 2, 1, mla=True, states=("dsa",)))
    try:
        states = {61: ([[3, 4, 5, 6, 7]], [[20, 21, 22, 23, 9]]), 62: ([[9, 1]], [[2, 15]])}
        assert_every_byte(move(c, rooms=ROOMS, states=states))
    finally:
        c.close()


def test_a_prefill_holding_another_count_of_window_pages_fails_the_room(model):
    c = Cluster(*layout(model, states=HYBRID))
    try:
        # The decode asks for three window pages, the prefill's window has two.
        states = {63: ([[2], [10, 11], [1]], [[7], [0, 5, 6], [2]])}
        (senders, receivers), = move(c, rooms=[(63, [1], [1], [2], 1)], states=states)
        assert senders[0]["status"] == KVPoll.Failed, senders
        assert "grant_mismatch" in senders[0]["reason"], senders
        assert receivers[0]["status"] == KVPoll.Failed, receivers
        assert receivers[0]["releasable"], receivers
    finally:
        c.close()


def test_a_decode_with_other_state_pools_is_refused_naming_both_values(model):
    c = Cluster(*layout(model, states=HYBRID, decode_states=("mamba",)))
    try:
        got = c.run({1: dict(room=66, src=[1], dst=[2], aux=1)})
        r = got[1]
        assert r["status"] == KVPoll.Failed, r
        assert "extra_pools" in r["reason"] and "3" in r["reason"] and "1" in r["reason"], r
    finally:
        c.close()


def test_state_pools_between_different_attention_tp_sizes_are_refused_naming_the_field(model):
    # Mamba state is split by heads like the KV: item for item it cannot go to a rank that
    # holds other heads.
    c = Cluster(*layout(model, 2, 1, states=("mamba",)))
    try:
        got = c.run({2: dict(room=67, src=[1], dst=[2], aux=1)})
        r = got[2]
        assert r["status"] == KVPoll.Failed, r
        assert "heads_count_with_extra_pools" in r["reason"], r
    finally:
        c.close()


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)], ids=["2_to_1", "1_to_2"])
def test_gdn_and_window_state_move_between_different_attention_tp_sizes_each_rank_its_share(
        model, prefill_tp, decode_tp):
    # SGLang's descriptors name each conv buffer's query, key and value sub-blocks and each
    # temporal buffer's heads: each decode rank's share of every slot comes from the prefill
    # ranks holding parts of it, every byte checked against one model-wide state.
    # The sliding-window pool's pages go by KV heads, as the KV pages do.
    c = Cluster(*layout(model, prefill_tp, decode_tp, states=("gdn", "swa")))
    try:
        states = {61: ([[2], [10, 11]], [[7], [0, 5]]), 62: ([[8], [3]], [[1], [11]])}
        assert_every_byte(move(c, rooms=ROOMS, states=states))
    finally:
        c.close()


def test_state_pools_on_a_pipeline_parallel_prefill_are_refused_at_start(model):
    with pytest.raises(AssertionError, match="pipeline-parallel prefill"):
        Cluster(*layout(model, pp=2, states=("mamba",)))


def test_a_state_type_kvferry_does_not_move_is_refused_at_start(model):
    with pytest.raises(AssertionError, match=r"state types \['dsa_tail'\]"):
        Cluster(*layout(model, states=("dsa_tail",)))
