"""kvferry's vLLM connector at TP > 1: vLLM's scheduler of each engine in the test's process,
each TP rank's worker connector in its own process over that rank's KV heads, their outputs
combined by vLLM's ``KVOutputAggregator`` (``ranks.py``). Every byte of every rank's heads is
checked."""

from __future__ import annotations

import logging
import secrets
import socket
import time

import pytest

from harness import assert_data_path
from kvferry.vllm import PUSH_BIT
from kvferry.vllm_proxy import push_params
from ranks import Ranks
from test_connector import prompt_of


def free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free (an engine's TP ranks listen on port + rank)."""
    for _ in range(100):
        socks = []
        try:
            socks.append(socket.socket())
            socks[0].bind(("127.0.0.1", 0))
            base = socks[0].getsockname()[1]
            if base + n >= 65536:
                continue
            for k in range(1, n):
                socks.append(socket.socket())
                socks[k].bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def prefill_all(prefill: Ranks, prompts: dict[str, list[int]], deadline: float = 60) -> dict[str, dict]:
    """Computes each prompt on the prefill engine for a remote decode; its params by request."""
    for req_id, prompt in prompts.items():
        prefill.add(req_id, prompt, 1, {"do_remote_decode": True})
    end = time.monotonic() + deadline
    while not prompts.keys() <= prefill.params.keys():
        assert time.monotonic() < end, f"prefill still computes: {prefill.scheduler.get_request_counts()}"
        prefill.step()
    # vLLM steps an engine once more after requests finished, to tell its workers.
    prefill.step()
    return {r: prefill.params[r] for r in prompts}


def load_all(decode: Ranks, prefill: Ranks | None, requests: dict[str, tuple[list[int], dict]],
             deadline: float = 60) -> dict[str, int]:
    """Adds each request to the decode with its params and steps both engines until each
    finished; checks every prompt block on every rank once a request runs on loaded KV.
    Returns the blocks checked by request."""
    from vllm.v1.request import RequestStatus

    for req_id, (prompt, params) in requests.items():
        decode.add(req_id, prompt, 3, dict(params))
    checked = {}
    end = time.monotonic() + deadline
    while len(decode.outputs.keys() & requests.keys()) < len(requests):
        assert time.monotonic() < end, f"decode still waits: {decode.scheduler.get_request_counts()}"
        decode.step()
        if prefill is not None:
            prefill.step()
        for req_id, (prompt, _) in requests.items():
            req = decode.scheduler.requests.get(req_id)
            if (req is not None and req_id not in checked and req.status == RequestStatus.RUNNING
                    and req_id not in decode.load_failures):
                checked[req_id] = decode.check_blocks(req_id, prompt)
        time.sleep(0.002)
    return checked


def drain(prefill: Ranks, timeout: float = 20) -> bool:
    """Steps the prefill until it holds no request (every block released); whether it did."""
    end = time.monotonic() + timeout
    while not prefill.idle() and time.monotonic() < end:
        prefill.step()
        time.sleep(0.01)
    return prefill.idle()


@pytest.fixture
def engines():
    made = []

    def make(role: str, tp: int, port: int | None = None, **kw) -> Ranks:
        made.append(Ranks(role, port or free_ports(tp * kw.get("pp", 1)), tp, **kw))
        return made[-1]

    yield make
    for engine in reversed(made):
        engine.shutdown()


def test_rooms_move_rank_to_rank_at_tp2_with_every_head_checked(engines):
    prefill = engines("kv_producer", 2)
    decode = engines("kv_consumer", 2)
    prompts = {f"t{i}": prompt_of(i, n) for i, n in enumerate([5, 32, 33, 100, 257])}
    params = prefill_all(prefill, prompts)
    for p in params.values():
        # One listener per prefill rank, in rank order.
        assert len(p["kvferry_addrs"]) == 2, p
    checked = load_all(decode, prefill, {r: (prompts[r], params[r]) for r in prompts})
    assert checked == {r: -(-len(p) // 32) for r, p in prompts.items()}
    assert decode.loaded == set(prompts) and not decode.load_failures
    assert decode.rank_rooms == [[len(prompts), 0], [len(prompts), 0]]
    assert_data_path(decode.session_paths(), received=True)
    # Each prefill rank let its blocks go once its room ended; vLLM freed them when both had.
    assert drain(prefill), "the prefill still holds blocks"


def test_push_rooms_move_rank_to_rank_at_tp2(engines):
    """The router draws the room and names every prefill rank's listener: each prefill rank
    pushes its heads to the decode rank of its index as the forward pass writes them."""
    prefill = engines("kv_producer", 2)
    decode = engines("kv_consumer", 2)
    prompts = {f"p{i}": prompt_of(20 + i, n) for i, n in enumerate([5, 100, 257])}
    requests = {}
    for req_id, prompt in prompts.items():
        room = PUSH_BIT | secrets.randbits(32)
        addrs = [f"127.0.0.1:{prefill.port + r}" for r in range(2)]
        requests[req_id] = (prompt, {"do_remote_prefill": True, "kvferry_push": True,
                                     "kvferry_room": room, "kvferry_addrs": addrs})
        prefill.add(req_id, prompt, 1, {"do_remote_decode": True, "kvferry_push": True, "kvferry_room": room})
    checked = load_all(decode, prefill, requests)
    assert checked == {r: -(-len(p) // 32) for r, p in prompts.items()}
    assert decode.loaded == set(prompts) and not decode.load_failures
    assert drain(prefill), "the prefill still holds blocks"


def test_a_rank_with_another_ranks_heads_is_caught_by_the_check(engines):
    """The check can fail: decode rank 0's blocks holding rank 1's heads are caught."""
    prefill = engines("kv_producer", 2)
    decode = engines("kv_consumer", 2)
    prompt = prompt_of(3, 100)
    params = prefill_all(prefill, {"h": prompt})
    load_all(decode, prefill, {"h": (prompt, params["h"])})
    decode.add("swapped", prompt, 3, None)
    decode.step()
    decode.plant_heads_of("swapped", prompt, rank=0, heads_of=1)
    with pytest.raises(AssertionError, match="rank 0: block 0 layer 0 differs"):
        decode.check_blocks("swapped", prompt)


def test_ranks_reordered_by_a_router_are_refused_not_loaded(engines):
    """A decode rank handed another prefill rank's listener would load other heads: each
    decode rank's room asks for the heads it holds, which the prefill rank it reached does
    not hold, so every rank's room fails and vLLM recomputes the request."""
    prefill = engines("kv_producer", 2)
    decode = engines("kv_consumer", 2)
    prompt = prompt_of(4, 100)
    params = prefill_all(prefill, {"r": prompt})["r"]
    params = dict(params, kvferry_addrs=list(reversed(params["kvferry_addrs"])))
    started = time.monotonic()
    load_all(decode, prefill, {"r": (prompt, params)}, deadline=30)
    assert "r" in decode.load_failures and "r" not in decode.loaded
    assert time.monotonic() - started < 15
    # Recomputed: the request ran and its blocks hold its own KV.
    assert decode.outputs["r"].finish_reason is not None


def test_a_killed_prefill_rank_fails_the_whole_request_and_decode_recomputes(engines):
    """Rank 0's part lands, rank 1's prefill is gone: vLLM hears of the request from both
    decode ranks, one with a failure, and recomputes it; no rank's success stands for the
    whole."""
    prefill = engines("kv_producer", 2)
    decode = engines("kv_consumer", 2)
    prompt = prompt_of(5, 100)
    params = prefill_all(prefill, {"k": prompt})["k"]
    prefill.kill(1)
    started = time.monotonic()
    load_all(decode, None, {"k": (prompt, params)}, deadline=30)
    assert "k" in decode.load_failures and "k" not in decode.loaded
    # Rank 0's room landed; rank 1's failed; the request is not loaded.
    assert decode.rank_rooms == [[1, 0], [0, 1]]
    # unreachable_timeout_ms is 2 s in these tests.
    assert time.monotonic() - started < 15
    assert decode.outputs["k"].finish_reason is not None
    assert decode.idle()


@pytest.mark.parametrize(
    "prefill_tp,decode_tp,kv_heads",
    [(2, 1, 2), (1, 2, 2), (4, 2, 4), (2, 4, 4), (2, 4, 2), (4, 2, 2), (4, 1, 2), (2, 1, 1)],
    ids=["2_to_1", "1_to_2", "4_to_2", "2_to_4", "2_to_4_replicated_heads",
         "4_to_2_prefill_replicates_heads", "4_to_1_prefill_replicates_heads", "2_to_1_mqa"],
)
def test_mha_heads_move_between_different_tp_sizes(engines, prefill_tp, decode_tp, kv_heads):
    """Each decode rank receives exactly its heads from the prefill ranks holding them (with
    more decode ranks than heads, each head to every rank that replicates it; with more
    prefill ranks than heads, each head from one of the ranks replicating it, the others
    idle sources whose blocks go back); the request loads only once every decode rank's
    room landed."""
    prefill = engines("kv_producer", prefill_tp, kv_heads=kv_heads)
    decode = engines("kv_consumer", decode_tp, kv_heads=kv_heads)
    prompts = {f"d{i}": prompt_of(30 + i, n) for i, n in enumerate([5, 100, 257])}
    params = prefill_all(prefill, prompts)
    checked = load_all(decode, prefill, {r: (prompts[r], params[r]) for r in prompts})
    assert checked == {r: -(-len(p) // 32) for r, p in prompts.items()}
    assert decode.loaded == set(prompts) and not decode.load_failures
    assert decode.rank_rooms == [[len(prompts), 0]] * decode_tp
    assert drain(prefill), "the prefill still holds blocks"


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)], ids=["2_to_1", "1_to_2"])
def test_hybrid_rooms_move_between_different_tp_sizes_with_every_groups_heads_checked(engines, prefill_tp, decode_tp):
    """vLLM's hybrid KV cache manager (layer 1 a 48-token sliding window, its own block
    table over the tensor both layers share) at different TP sizes: each decode rank
    receives its heads of every group's blocks the next token attends to, every byte
    checked."""
    prefill = engines("kv_producer", prefill_tp, window=48)
    decode = engines("kv_consumer", decode_tp, window=48)
    prompts = {f"w{i}": prompt_of(40 + i, n) for i, n in enumerate([5, 48, 100, 257])}
    params = prefill_all(prefill, prompts)
    assert all(p["kvferry_shape"]["kv_groups"] == [["full", 0], ["sliding_window", 48]] for p in params.values())
    checked = load_all(decode, prefill, {r: (prompts[r], params[r]) for r in prompts})
    assert checked == {r: -(-len(p) // 32) for r, p in prompts.items()}
    assert decode.loaded == set(prompts) and not decode.load_failures
    assert decode.rank_rooms == [[len(prompts), 0]] * decode_tp
    assert drain(prefill), "the prefill still holds blocks"


def test_a_tp_pair_the_heads_cannot_serve_is_refused_naming_both_sizes(engines, caplog):
    # Every TP pair vLLM itself accepts here is served: a router's params naming a third
    # prefill rank claim a TP 3 prefill, whose ranks cannot hold 2 KV heads evenly.
    prefill = engines("kv_producer", 2, kv_heads=2)
    decode = engines("kv_consumer", 2, kv_heads=2)
    prompt = prompt_of(6, 100)
    params = prefill_all(prefill, {"m": prompt})["m"]
    params = dict(params, kvferry_addrs=params["kvferry_addrs"] + params["kvferry_addrs"][:1])
    with caplog.at_level(logging.ERROR, logger="kvferry.vllm"):
        load_all(decode, prefill, {"m": (prompt, params)}, deadline=30)
    assert "m" in decode.load_failures
    assert "the prefill runs TP 3" in caplog.text and "this decode TP 2" in caplog.text, caplog.text
    assert "do not split evenly" in caplog.text, caplog.text
    assert decode.outputs["m"].finish_reason is not None


def test_data_parallel_prefill_engines_of_one_host_listen_apart_and_feed_one_decode(engines):
    """Two DP engines given one ``port``: each rank listens on port + DP index x TP + rank,
    and a decode loads from either."""
    base = free_ports(4)
    prefills = [engines("kv_producer", 2, port=base, dp=(i, 2)) for i in range(2)]
    decode = engines("kv_consumer", 2)
    prompts = {f"dp{i}": prompt_of(40 + i, n) for i, n in enumerate([33, 100, 257, 64])}
    params = {}
    for i, (req_id, prompt) in enumerate(prompts.items()):
        params.update(prefill_all(prefills[i % 2], {req_id: prompt}))
    assert params["dp0"]["kvferry_addrs"] == [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]
    assert params["dp1"]["kvferry_addrs"] == [f"127.0.0.1:{base + 2}", f"127.0.0.1:{base + 3}"]
    checked = {}
    for i, req_id in enumerate(prompts):
        checked.update(load_all(decode, prefills[i % 2], {req_id: (prompts[req_id], params[req_id])}))
    assert checked == {r: -(-len(p) // 32) for r, p in prompts.items()}
    assert decode.loaded == set(prompts) and not decode.load_failures
    assert all(drain(p) for p in prefills), "a prefill still holds blocks"


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 2), (2, 1), (1, 2), (4, 2)],
                         ids=["2_to_2", "2_to_1", "1_to_2", "4_to_2"])
def test_mla_latent_kv_moves_once_per_decode_rank(engines, prefill_tp, decode_tp):
    """Every rank holds the whole latent KV: each decode rank loads it from one prefill rank
    (``rank % prefill TP``), and a prefill rank no decode rank loads from is an idle source
    that only confirms, so it frees its blocks as soon as the room ends."""
    prefill = engines("kv_producer", prefill_tp, mla=True)
    decode = engines("kv_consumer", decode_tp, mla=True)
    prompts = {f"m{i}": prompt_of(50 + i, n) for i, n in enumerate([5, 100, 257])}
    params = prefill_all(prefill, prompts)
    checked = load_all(decode, prefill, {r: (prompts[r], params[r]) for r in prompts})
    bs = decode.config.cache_config.block_size  # vLLM picks MLA's block size
    assert checked == {r: -(-len(p) // bs) for r, p in prompts.items()}
    assert decode.loaded == set(prompts) and not decode.load_failures
    assert drain(prefill, timeout=10), "a prefill rank still holds blocks"


@pytest.mark.parametrize("prefill_pp,prefill_tp,decode_tp", [(2, 1, 1), (2, 2, 1), (2, 1, 2)],
                         ids=["pp2_to_tp1", "pp2_tp2_to_tp1", "pp2_to_tp2"])
def test_a_pipeline_parallel_prefill_sends_each_stages_layers(engines, prefill_pp, prefill_tp, decode_tp):
    """Each stage's workers hold their layers: every decode rank's room is fed by the ranks
    holding its heads in every stage, and lands only when every stage's layers did."""
    prefill = engines("kv_producer", prefill_tp, pp=prefill_pp)
    decode = engines("kv_consumer", decode_tp)
    prompts = {f"s{i}": prompt_of(60 + i, n) for i, n in enumerate([5, 100, 257])}
    params = prefill_all(prefill, prompts)
    for p in params.values():
        assert p["kvferry_pp"] == prefill_pp and len(p["kvferry_addrs"]) == prefill_pp * prefill_tp, p
    checked = load_all(decode, prefill, {r: (prompts[r], params[r]) for r in prompts})
    assert checked == {r: -(-len(p) // 32) for r, p in prompts.items()}
    assert decode.loaded == set(prompts) and not decode.load_failures
    assert drain(prefill), "a prefill stage still holds blocks"


@pytest.mark.parametrize("prefill_tp", [1, 2], ids=["pp2_to_tp1", "pp2_tp2_to_tp1"])
def test_push_rooms_from_a_pipeline_parallel_prefill_take_every_stages_layers(engines, prefill_tp):
    """Push mode with the router's params (``kvferry.vllm_proxy``'s ``URL=pp=2,...``): every
    stage's workers push their layers as the forward pass writes them, and the decode's room
    lands only once every stage's did."""
    prefill = engines("kv_producer", prefill_tp, pp=2)
    decode = engines("kv_consumer", 1)
    prompts = {f"q{i}": prompt_of(80 + i, n) for i, n in enumerate([5, 100, 257])}
    requests = {}
    for req_id, prompt in prompts.items():
        addrs = [f"127.0.0.1:{prefill.port + w}" for w in range(2 * prefill_tp)]
        to_prefill, to_decode = push_params(PUSH_BIT | secrets.randbits(32), addrs, 2)
        requests[req_id] = (prompt, to_decode)
        prefill.add(req_id, prompt, 1, to_prefill)
    checked = load_all(decode, prefill, requests)
    assert checked == {r: -(-len(p) // 32) for r, p in prompts.items()}
    assert decode.loaded == set(prompts) and not decode.load_failures
    assert drain(prefill), "a prefill stage still holds blocks"


def test_a_killed_pipeline_stage_fails_the_whole_request(engines):
    """Stage 0's layers land, stage 1's worker is gone: the room never counts as loaded."""
    prefill = engines("kv_producer", 1, pp=2)
    decode = engines("kv_consumer", 1)
    prompt = prompt_of(70, 100)
    params = prefill_all(prefill, {"k": prompt})["k"]
    prefill.kill(1)
    load_all(decode, None, {"k": (prompt, params)}, deadline=30)
    assert "k" in decode.load_failures and "k" not in decode.loaded
    assert decode.outputs["k"].finish_reason is not None


def test_recurrent_state_moves_rank_to_rank_at_tp2_with_every_ranks_shard_checked(engines):
    """Each rank keeps its shard of a Mamba/GDN layer's state beside its heads of a full
    attention layer: rank r's room carries its attention blocks of all but the prompt's last
    token and its state block, and the decode rank r recomputes the last token from it."""
    prefill = engines("kv_producer", 2, mamba=True)
    decode = engines("kv_consumer", 2, mamba=True)
    prompts = {f"s{i}": prompt_of(50 + i, n) for i, n in enumerate([2, 33, 100, 257])}
    params = prefill_all(prefill, prompts)
    checked = load_all(decode, prefill, {r: (prompts[r], params[r]) for r in prompts})
    assert checked == {r: -(-(len(p) - 1) // 32) for r, p in prompts.items()}
    assert decode.loaded == set(prompts) and not decode.load_failures
    assert decode.rank_rooms == [[len(prompts), 0], [len(prompts), 0]]
    assert drain(prefill), "the prefill still holds blocks"


def test_a_rank_with_another_ranks_state_is_caught_by_the_check(engines):
    """The check can fail: decode rank 0 holding rank 1's shard of the state is caught."""
    prefill = engines("kv_producer", 2, mamba=True)
    decode = engines("kv_consumer", 2, mamba=True)
    prompt = prompt_of(5, 100)
    params = prefill_all(prefill, {"m": prompt})
    load_all(decode, prefill, {"m": (prompt, params["m"])})
    decode.add("swapped", prompt, 3, None)
    # Computed here (chunked: 64 tokens a step) until its blocks hold the whole prompt.
    while len(decode.tables_of("swapped")[0]) < -(-(len(prompt) - 1) // 32):
        decode.step()
    # What a load would leave: each rank its own heads and shard of the state: checks out.
    for rank in (0, 1):
        decode.plant_heads_of("swapped", prompt, rank=rank, heads_of=rank)
    decode.check_blocks("swapped", prompt)
    decode.plant_heads_of("swapped", prompt, rank=0, heads_of=1)
    with pytest.raises(AssertionError, match="rank 0: the state differs"):
        decode.check_blocks("swapped", prompt)


def test_recurrent_state_of_ranks_reordered_by_a_router_is_refused_not_loaded(engines):
    """Blocks holding state declare no heads, so each rank's room is bound to its rank: a
    decode rank handed another prefill rank's listener is refused, and vLLM recomputes."""
    prefill = engines("kv_producer", 2, mamba=True)
    decode = engines("kv_consumer", 2, mamba=True)
    prompt = prompt_of(6, 100)
    params = prefill_all(prefill, {"r": prompt})["r"]
    params = dict(params, kvferry_addrs=list(reversed(params["kvferry_addrs"])))
    load_all(decode, prefill, {"r": (prompt, params)}, deadline=30)
    assert "r" in decode.load_failures and "r" not in decode.loaded


@pytest.mark.parametrize("prefill_tp,decode_tp,kind", [(2, 1, "gdn"), (1, 2, "gdn"), (4, 2, "gdn"), (2, 4, "gdn"),
                                                       (2, 1, "mamba2"), (1, 2, "mamba2")],
                         ids=["2_to_1", "1_to_2", "4_to_2_prefill_replicates_heads", "2_to_4",
                              "mamba2_2_to_1", "mamba2_1_to_2"])
def test_recurrent_state_moves_between_different_tp_sizes_with_every_ranks_share_checked(
        engines, prefill_tp, decode_tp, kind):
    """A GDN layer's state split by TP rank (each conv row's query, key and value channels,
    the SSM state's value heads), or a Mamba2 layer's (x, B and C channels, heads): each
    decode rank's share comes from the prefill ranks holding parts of it, row by row, beside
    its KV heads, and the decode recomputes the prompt's last token from it."""
    prefill = engines("kv_producer", prefill_tp, mamba=kind)
    decode = engines("kv_consumer", decode_tp, mamba=kind)
    prompts = {f"d{i}": prompt_of(70 + i, n) for i, n in enumerate([2, 33, 100])}
    params = prefill_all(prefill, prompts)
    checked = load_all(decode, prefill, {r: (prompts[r], params[r]) for r in prompts})
    assert checked == {r: -(-(len(p) - 1) // 32) for r, p in prompts.items()}
    assert decode.loaded == set(prompts) and not decode.load_failures
    assert drain(prefill), "the prefill still holds blocks"


def test_a_killed_prefill_rank_holding_part_of_the_state_fails_the_load_and_decode_recomputes(engines):
    """Prefill TP 2 -> decode TP 1: rank 1 holds half of the decode rank's state and heads and
    is gone. The decode's room fails within the unreachable timeout rather than loading half
    a state, and vLLM recomputes the request."""
    prefill = engines("kv_producer", 2, mamba=True)
    decode = engines("kv_consumer", 1, mamba=True)
    prompt = prompt_of(90, 100)
    params = prefill_all(prefill, {"h": prompt})["h"]
    prefill.kill(1)
    started = time.monotonic()
    load_all(decode, None, {"h": (prompt, params)}, deadline=30)
    assert "h" in decode.load_failures and "h" not in decode.loaded
    assert decode.rank_rooms == [[0, 1]]
    assert time.monotonic() - started < 15
    assert decode.idle()


def test_push_rooms_carry_each_decode_ranks_share_of_the_state_between_tp_sizes(engines):
    """Push mode, prefill TP 2 -> decode TP 1: both prefill ranks push their heads as the
    forward pass writes them, and their shares of the final state with the last chunk."""
    prefill = engines("kv_producer", 2, mamba=True)
    decode = engines("kv_consumer", 1, mamba=True)
    prompts = {f"q{i}": prompt_of(80 + i, n) for i, n in enumerate([33, 100])}
    requests = {}
    for req_id, prompt in prompts.items():
        room = PUSH_BIT | secrets.randbits(32)
        addrs = [f"127.0.0.1:{prefill.port + r}" for r in range(2)]
        requests[req_id] = (prompt, {"do_remote_prefill": True, "kvferry_push": True,
                                     "kvferry_room": room, "kvferry_addrs": addrs})
        prefill.add(req_id, prompt, 1, {"do_remote_decode": True, "kvferry_push": True, "kvferry_room": room})
    checked = load_all(decode, prefill, requests)
    assert checked == {r: -(-(len(p) - 1) // 32) for r, p in prompts.items()}
    assert decode.loaded == set(prompts) and not decode.load_failures
    assert drain(prefill), "the prefill still holds blocks"

