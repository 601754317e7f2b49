"""The SGLang layouts people run, through SGLang 0.5.23's own classes, one process per rank:
attention TP that differs between prefill and decode (MHA head slices, both directions),
MLA, DP attention, pipeline-parallel prefill, a decode-side prefix; faults (a contributing
prefill rank killed mid-room) and a head-count mismatch. Every byte of every granted decode
page is checked against what the prefill held, head by head."""

import pytest
from sglang.srt.disaggregation.base.conn import KVPoll

import cluster
from cluster import Cluster, Spec

# (room, prefill pages, chunks, decode pages, aux slot)
ROOMS = [
    (11, [3, 4, 5, 6, 7], [2, 2, 1], [20, 21, 22, 23, 9], 1),
    (12, [9, 1], [2], [2, 15], 2),
    (13, [0, 23, 15], [1, 1, 1], [10, 11, 12], 3),
]


@pytest.fixture(scope="module")
def model():
    return cluster.model_dir()


def layout(
    model, prefill_tp=1, decode_tp=1, mla=False, pp=1, dp=1, decode_heads=None, states=(),
    decode_states=None,
):
    """The specs of a prefill server and a decode server of these widths (and state pools)."""
    prefill = [
        Spec(
            "prefill", r, tp=prefill_tp * dp, pp=pp, dp=dp, mla=mla, model=model,
            kv_heads=cluster.KV_HEADS, states=tuple(states),
        )
        for r in range(prefill_tp * dp * pp)
    ]
    decode = [
        Spec(
            "decode", r, tp=decode_tp * dp, dp=dp, mla=mla, model=model, kv_heads=decode_heads,
            states=tuple(states if decode_states is None else decode_states),
        )
        for r in range(decode_tp * dp)
    ]
    return prefill, decode


def move(c: Cluster, rooms=ROOMS, prefix_pages=0, dp=1, states=None, **extra):
    """Every prefill rank sends and every decode rank receives each room (with DP, only the
    ranks of the room's DP group); returns each room's decode results. ``states[room]``:
    the room's (prefill, decode) state items per pool."""
    prefills, decodes = c.ranks("prefill"), c.ranks("decode")
    outcomes = []
    for room, src, chunks, dst, aux in rooms:
        group = room % dp
        cmds = {}
        for i, (spec, *_rest) in enumerate(c.procs):
            tp = spec.tp // spec.dp
            if spec.world_rank // tp % dp != group:
                continue
            state_src, state_dst = (states or {}).get(room, (None, None))
            if spec.role == "prefill":
                cmds[i] = dict(room=room, src=src, chunks=chunks, aux=aux, state_src=state_src)
            else:
                cmds[i] = dict(
                    room=room, src=src, dst=dst, aux=aux, prefix_pages=prefix_pages,
                    prefill_dp_rank=group, state_src=state_src, state_dst=state_dst, **extra,
                )
        got = c.run(cmds)
        outcomes.append(
            (
                [got[i] for i in cmds if c.procs[i][0].role == "prefill"],
                [got[i] for i in cmds if c.procs[i][0].role == "decode"],
            )
        )
    assert prefills and decodes
    return outcomes


def assert_every_byte(outcomes):
    for senders, receivers in outcomes:
        for r in receivers:
            assert r["status"] == KVPoll.Success, r
            assert r["mismatch"] is None, r
            cluster.assert_data_path(r["paths"], received=True)
        for s in senders:
            assert s["status"] == KVPoll.Success, s
            cluster.assert_data_path(s["paths"], received=False)


@pytest.mark.parametrize(
    "prefill_tp,decode_tp",
    [(2, 1), (1, 2), (4, 2)],
    ids=["prefill_tp2_to_decode_tp1", "prefill_tp1_to_decode_tp2", "prefill_tp4_to_decode_tp2"],
)
def test_mha_heads_move_between_different_tp_sizes(model, prefill_tp, decode_tp):
    c = Cluster(*layout(model, prefill_tp, decode_tp))
    try:
        outcomes = move(c, swap_heads=True)
        assert_every_byte(outcomes)
        swaps = [r.get("swap_caught") for _s, rs in outcomes for r in rs]
        assert swaps and all(swaps), "the byte check must see two heads swapped"
    finally:
        c.close()


@pytest.mark.parametrize(
    "prefill_tp,decode_tp", [(2, 1), (1, 2)], ids=["prefill_tp2_to_decode_tp1", "prefill_tp1_to_decode_tp2"]
)
def test_mla_latent_kv_moves_once_per_decode_rank(model, prefill_tp, decode_tp):
    c = Cluster(*layout(model, prefill_tp, decode_tp, mla=True))
    try:
        outcomes = move(c)
        assert_every_byte(outcomes)
    finally:
        c.close()


def test_dp_attention_rooms_go_to_their_dp_rank(model):
    # Prefill and decode with two DP attention groups of one rank each: room r belongs to
    # group r % 2 on both sides, and only that group's ranks take part.
    c = Cluster(*layout(model, 1, 1, dp=2))
    try:
        rooms = [(20, [1, 2], [2], [5, 6], 1), (21, [3], [1], [7], 2), (23, [4, 5, 6], [1, 2], [1, 2, 3], 3)]
        outcomes = move(c, rooms=rooms, dp=2)
        assert_every_byte(outcomes)
        assert all(len(s) == 1 and len(r) == 1 for s, r in outcomes)
    finally:
        c.close()


def test_pipeline_stages_each_send_their_layers(model):
    # Two prefill PP stages (layers 0 and 1..2 of 3) into one decode rank holding all three.
    c = Cluster(*layout(model, 1, 1, pp=2))
    try:
        assert_every_byte(move(c))
    finally:
        c.close()


def test_pipeline_stages_with_tp_send_their_heads_of_their_layers(model):
    c = Cluster(*layout(model, 2, 1, pp=2))
    try:
        assert_every_byte(move(c))
    finally:
        c.close()


def test_a_decode_prefix_stays_and_only_the_rest_moves(model):
    c = Cluster(*layout(model, 2, 1))
    try:
        rooms = [(30, [3, 4, 5, 6, 7], [2, 3], [20, 21, 22, 23, 9], 1), (31, [8, 9], [1, 1], [1, 2], 2)]
        assert_every_byte(move(c, rooms=rooms, prefix_pages=1))
    finally:
        c.close()


@pytest.mark.parametrize("widths", [dict(prefill_tp=2), dict(pp=2)], ids=["tp_rank", "pp_stage"])
def test_a_killed_contributing_prefill_rank_fails_the_decode_room_within_its_deadline(model, widths):
    import time

    c = Cluster(*layout(model, **widths))
    try:
        prefill0, prefill1, decode = 0, 1, 2
        started = time.monotonic()
        got = c.run(
            {
                prefill0: dict(room=40, src=[1, 2, 3, 4], chunks=[2, 2], aux=1),
                prefill1: dict(room=40, src=[1, 2, 3, 4], chunks=[2, 2], aux=1, die_after_first_chunk=True),
                decode: dict(room=40, src=[1, 2, 3, 4], dst=[5, 6, 7, 8], aux=1),
            }
        )
        took = time.monotonic() - started
        assert got[prefill1].get("died")
        r = got[decode]
        assert r["status"] == KVPoll.Failed, r
        assert any(x in r["reason"] for x in ("connection_lost", "peer_unreachable", "peer_silent")), r
        assert r["releasable"], "the failed room's pages are released once no write can land"
        assert took < cluster.DEADLINE_S, took
    finally:
        c.close()


def test_a_head_count_mismatch_is_refused_naming_both_values(model):
    # The decode's KVArgs say 8 KV heads; the prefill holds 4.
    c = Cluster(*layout(model, 1, 1, decode_heads=8))
    try:
        got = c.run({1: dict(room=50, src=[1], dst=[2], aux=1)})
        r = got[1]
        assert r["status"] == KVPoll.Failed, r
        assert "heads_total" in r["reason"] and "8" in r["reason"] and "4" in r["reason"], r
    finally:
        c.close()
