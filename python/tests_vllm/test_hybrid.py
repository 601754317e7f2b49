"""vLLM's hybrid KV cache manager through kvferry: a model with a full-attention layer and a
sliding-window layer, each its own KV cache group with its own block table over one shared
tensor. Every group's blocks move with the request (the sliding window's only from the
first block its window still needs: vLLM freed the ones before), and every byte of every
block the decode attends to is checked."""

from __future__ import annotations

import logging
import secrets
import time

import pytest

from harness import Side, assert_data_path
from test_connector import Prefill, ports, prompt_of, push_params, push_rooms, run_decode  # noqa: F401

from kvferry.vllm import PUSH_BIT

#: Tokens of the sliding window: a 257-token prompt keeps its last 3 of 9 blocks in it.
WINDOW = 48


def rooms_opened(decode: Side) -> dict[str, list[int]]:
    """The pages each decode room opened over, by request, as the decode opens them."""
    opened: dict[str, list[int]] = {}
    open_now = decode.worker._worker._open_now

    def spy(req_id, recv):
        opened[req_id] = list(recv.blocks)
        return open_now(req_id, recv)

    decode.worker._worker._open_now = spy
    return opened


def attended(side: Side, prompt: list[int]) -> int:
    """Blocks of both layers the decode attends to for ``prompt``'s next token."""
    n = -(-len(prompt) // 32)
    return n + n - side.first_block(1, len(prompt))


@pytest.mark.parametrize("local", [{"window": WINDOW}, {"chunk": 64}], ids=["sliding_window", "chunked_local"])
def test_hybrid_rooms_move_every_groups_blocks_with_every_byte_checked(ports, local):
    prefill = Prefill(ports[0], **local)
    decode = Side("kv_consumer", ports[1], **local)
    opened = rooms_opened(decode)
    try:
        # Under a block, exactly the window, past it by a block, and far past it.
        lengths = [5, 48, 100, 257, 150]
        prompts = {f"h{i}": prompt_of(i, n) for i, n in enumerate(lengths)}
        for req_id, prompt in prompts.items():
            prefill.prefill(req_id, prompt)
            rid, params = prefill.params()
            kind = ["sliding_window", WINDOW] if "window" in local else ["chunked_local", 64]
            assert params["kvferry_shape"]["kv_groups"] == [["full", 0], kind]
            checked = run_decode(decode, {rid: (prompt, params)})
            assert checked == {rid: -(-len(prompt) // 32)}
            # The room held exactly the blocks the decode attends to: 9 + 3 for 257 tokens.
            assert len(opened[rid]) == attended(decode, prompt), (rid, opened[rid])
        # 257 tokens: 9 blocks of full attention, and the window's last 3 (48 tokens) or
        # the chunk's last block (tokens 256-257).
        assert len(opened["h3"]) == (12 if "window" in local else 10)
        assert not decode.load_failures, decode.load_failures
        assert_data_path(decode.worker.session_paths(), received=True)
    finally:
        decode.shutdown()
        assert prefill.stop(), "the prefill still holds requests (blocks never released)"


def test_a_decode_holding_a_prompts_first_blocks_loads_the_rest_of_every_group(ports):
    """A local prefix hit on the decode (its first two blocks in both groups): the room
    holds the rest of each group, and the prefill sends exactly those blocks."""
    prefill = Prefill(ports[0], window=WINDOW)
    decode = Side("kv_consumer", ports[1], window=WINDOW)
    opened = rooms_opened(decode)
    try:
        first = prompt_of(1, 70)
        prefill.prefill("a", first)
        rid, params = prefill.params()
        assert run_decode(decode, {rid: (first, params)}) == {"a": 3}
        # 64 tokens in common: two blocks the decode computed (loaded) and cached.
        second = first[:64] + prompt_of(5, 86)
        prefill.prefill("b", second)
        rid, params = prefill.params()
        assert run_decode(decode, {rid: (second, params)}, held=2) == {"b": 5}
        # Full attention's blocks 2-4 and the window's 3-4, of 5 + 2 the prefill holds.
        assert len(opened["b"]) == 5, opened
        assert not decode.load_failures, decode.load_failures
    finally:
        decode.shutdown()
        assert prefill.stop(), "the prefill still holds requests (blocks never released)"


def test_hybrid_push_rooms_move_layer_by_layer_with_every_byte_checked(ports):
    """Push mode over a hybrid model: each step's blocks of both groups go as the forward
    pass writes them; a block the window frees later is never sent."""
    prefill = Prefill(ports[0], window=WINDOW)
    decode = Side("kv_consumer", ports[1], window=WINDOW)
    try:
        lengths = [5, 100, 257, 150]
        push_rooms(prefill, decode, {f"p{i}": prompt_of(20 + i, n) for i, n in enumerate(lengths)}, ports[0])
    finally:
        decode.shutdown()
        assert prefill.stop(), "the prefill still holds requests (blocks never released)"
    assert prefill.chunks["layerwise"] > 0, prefill.chunks


def test_a_block_of_the_window_swapped_with_a_full_attention_block_is_caught(ports):
    """The check can fail: a decode whose window block holds the full-attention layer's
    bytes is caught."""
    from vllm.v1.request import RequestStatus

    prefill = Prefill(ports[0], window=WINDOW)
    decode = Side("kv_consumer", ports[1], window=WINDOW)
    try:
        prompt = prompt_of(3, 100)
        prefill.prefill("s", prompt)
        rid, params = prefill.params()
        decode.add(rid, prompt, 3, dict(params))
        deadline = time.monotonic() + 30
        while decode.scheduler.requests[rid].status != RequestStatus.RUNNING:
            assert time.monotonic() < deadline
            decode.step()
            time.sleep(0.002)
        decode.check_blocks(rid, prompt)
        full, window = decode.blocks_of(rid, 0), decode.blocks_of(rid, 1)
        decode.block_bytes_of(window[3], 1).copy_(decode.block_bytes_of(full[3], 0))
        with pytest.raises(AssertionError, match="block 3 layer 1 differs"):
            decode.check_blocks(rid, prompt)
    finally:
        decode.shutdown()
        prefill.stop()


@pytest.mark.parametrize("prefill_window", [0, 32], ids=["full_only_prefill", "other_window"])
def test_a_prefill_whose_kv_cache_groups_differ_is_refused_naming_both(ports, caplog, prefill_window):
    prefill = Prefill(ports[0], window=prefill_window)
    decode = Side("kv_consumer", ports[1], window=WINDOW)
    try:
        prompt = prompt_of(4, 100)
        prefill.prefill("g", prompt)
        rid, params = prefill.params()
        with caplog.at_level(logging.ERROR, logger="kvferry.vllm"):
            run_decode(decode, {rid: (prompt, params)})
        assert rid in decode.load_failures
        assert "kv_groups: prefill" in caplog.text and f"['sliding_window', {WINDOW}]" in caplog.text, caplog.text
        # vLLM recomputed it.
        assert decode.outputs[rid].finish_reason is not None
        if prefill_window:
            # Nodes of one layout: the decode tells the prefill at once to let its blocks go
            # (of another layout, kvferry's handshake refuses even that: the lease ends it).
            assert prefill.wait_idle(20)
    finally:
        decode.shutdown()
        prefill.stop()


def test_a_push_room_between_engines_of_different_groups_is_refused_not_loaded(ports, caplog):
    """Push mode: nothing names the prefill's groups to the decode before the room opens,
    so the room is bound to them: the prefill refuses it and the decode recomputes."""
    from vllm.v1.request import RequestStatus

    prefill = Prefill(ports[0], window=32)
    decode = Side("kv_consumer", ports[1], window=WINDOW)
    try:
        prompt = prompt_of(6, 150)
        room = PUSH_BIT | secrets.randbits(32)
        with caplog.at_level(logging.ERROR, logger="kvferry.vllm"):
            decode.add("q", prompt, 3, push_params(room, ports[0]))
            decode.step()
            prefill.prefill("q", prompt, room=room)
            deadline = time.monotonic() + 30
            while "q" not in decode.outputs:
                assert time.monotonic() < deadline, decode.scheduler.get_request_counts()
                decode.step()
                time.sleep(0.002)
        assert "q" in decode.load_failures
        assert "prompt_mismatch" in caplog.text, caplog.text
        assert decode.scheduler.requests.get("q") is None or decode.scheduler.requests["q"].status != RequestStatus.RUNNING
        prefill.params()
        assert prefill.wait_idle(20)
    finally:
        decode.shutdown()
        prefill.stop()


def test_a_hybrid_prefill_is_refused_by_a_decode_of_one_group_naming_both(ports, caplog):
    prefill = Prefill(ports[0], window=WINDOW)
    decode = Side("kv_consumer", ports[1])
    try:
        prompt = prompt_of(7, 100)
        prefill.prefill("r", prompt)
        rid, params = prefill.params()
        with caplog.at_level(logging.ERROR, logger="kvferry.vllm"):
            run_decode(decode, {rid: (prompt, params)})
        assert rid in decode.load_failures
        assert f"kv_groups: prefill [['full', 0], ['sliding_window', {WINDOW}]], decode None" in caplog.text, caplog.text
        assert decode.outputs[rid].finish_reason is not None
    finally:
        decode.shutdown()
        prefill.stop()


def test_recurrent_state_moves_after_the_prompts_blocks_and_the_decode_recomputes_the_last_token(ports):
    """A Mamba/GDN layer beside a full-attention one: the prefill computes all but the
    prompt's last token, its state block goes after the attention blocks, and the decode
    loads both and recomputes the last token from that state."""
    prefill = Prefill(ports[0], mamba=True)
    decode = Side("kv_consumer", ports[1], mamba=True)
    opened = {}
    open_now = decode.worker._worker._open_now

    def spy(req_id, recv):
        opened[req_id] = list(recv.blocks)
        return open_now(req_id, recv)

    decode.worker._worker._open_now = spy
    try:
        lengths = [2, 33, 100, 257]
        for i, n in enumerate(lengths):
            prompt = prompt_of(30 + i, n)
            prefill.prefill(f"m{i}", prompt)
            rid, params = prefill.params()
            assert params["kvferry_shape"]["kv_groups"] == [
                ["full", 0], ["state", 1], ["state_layout", "[[3, 64], [4, 8, 8]] ['float32', 'float32']"]]
            checked = run_decode(decode, {rid: (prompt, params)})
            # The attention blocks of n - 1 tokens, and the state block.
            assert checked == {rid: -(-(n - 1) // 32)}
            # The room's last page is the state block (``check_blocks`` checked its bytes).
            assert len(opened[rid]) == -(-(n - 1) // 32) + 1
        assert not decode.load_failures, decode.load_failures
    finally:
        decode.shutdown()
        assert prefill.stop(), "the prefill still holds requests (blocks never released)"


def test_push_rooms_of_a_model_with_recurrent_state_carry_the_final_state(ports):
    prefill = Prefill(ports[0], mamba=True)
    decode = Side("kv_consumer", ports[1], mamba=True)
    try:
        prompts = {f"q{i}": prompt_of(40 + i, n) for i, n in enumerate([100, 257])}
        rooms = {r: PUSH_BIT | secrets.randbits(32) for r in prompts}
        for req_id, prompt in prompts.items():
            # The decode asks first: the room waits for every chunk, the state's last.
            decode.add(req_id, prompt, 3, push_params(rooms[req_id], ports[0]))
            decode.step()
            prefill.prefill(req_id, prompt, room=rooms[req_id])
        from vllm.v1.request import RequestStatus

        deadline = time.monotonic() + 60
        checked = {}
        while len(decode.outputs.keys() & prompts.keys()) < len(prompts):
            assert time.monotonic() < deadline, decode.scheduler.get_request_counts()
            decode.step()
            for req_id, prompt in prompts.items():
                req = decode.scheduler.requests.get(req_id)
                if req is not None and req_id not in checked and req.status == RequestStatus.RUNNING:
                    checked[req_id] = decode.check_blocks(req_id, prompt)
            time.sleep(0.002)
        assert checked == {"q0": 4, "q1": 8}
        assert not decode.load_failures, decode.load_failures
        for _ in prompts:
            prefill.params()
    finally:
        decode.shutdown()
        assert prefill.stop(), "the prefill still holds requests (blocks never released)"


def test_a_one_token_prompt_of_a_model_with_recurrent_state_is_computed_by_the_decode(ports):
    """Nothing to load (the decode recomputes the prompt's last token, its only one): the
    decode computes it and tells the prefill to let the room's blocks go."""
    prefill = Prefill(ports[0], mamba=True)
    decode = Side("kv_consumer", ports[1], mamba=True)
    try:
        prefill.prefill("one", [17])
        rid, params = prefill.params()
        decode.add(rid, [17], 3, dict(params))
        deadline = time.monotonic() + 30
        while rid not in decode.outputs:
            assert time.monotonic() < deadline, decode.scheduler.get_request_counts()
            decode.step()
            time.sleep(0.002)
        assert rid not in decode.loaded and rid not in decode.load_failures
        # vLLM steps once more to tell its workers of the finished request: the release
        # goes with that step.
        while decode.scheduler.has_requests():
            decode.step()
        assert prefill.wait_idle(20), "the prefill still holds the room's blocks"
    finally:
        decode.shutdown()
        prefill.stop()
