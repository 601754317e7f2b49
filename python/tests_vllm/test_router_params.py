"""Whatever kv_transfer_params a router hands a decode engine, every request ends (a load
failure vLLM recomputes, never a hang), the engine keeps serving, and no exception reaches
vLLM's scheduler or disappears in a worker thread."""

from __future__ import annotations

import logging
import random
import time

import pytest

from harness import Side
from test_connector import Prefill, free_port, prompt_of

from kvferry.vllm import kv_shape


#: Room and address values a router (or a bug in one) may send, none of which names a
#: prefill room kvferry can load from (integers past vLLM's own bound on params, -2**63..2**64-1,
#: never reach a connector).
BAD_ROOMS = [-1, 0, -(2**63), "12", 1.5, True, None, [5], {"room": 5}, 2**64 - 1, (1 << 62) | 5]
BAD_ADDRS = [39600, [39600], "127.0.0.1:39600", [], ["localhost:39600"], ["127.0.0.1:99999"],
             ["127.0.0.1"], [["127.0.0.1", 39600]], [None], ["127.0.0.1:39600"] * 65, None,
             {"a": "127.0.0.1:39600"}]


def bad_params(shape: dict, rng: random.Random) -> dict:
    """A perturbed or garbage kv_transfer_params: one field broken or missing, or both."""
    good_room, good_addrs = 5, ["127.0.0.1:9"]
    params = {"do_remote_prefill": True, "do_remote_decode": False, "kvferry_shape": shape}
    kind = rng.randrange(4)
    room = rng.choice(BAD_ROOMS) if kind in (0, 2) else good_room
    addrs = rng.choice(BAD_ADDRS) if kind in (1, 2) else good_addrs
    if kind == 3:
        params["kvferry_shape"] = rng.choice(["x", None, 7, {"block_size": "32"}])
        room, addrs = good_room, good_addrs
    for key, value in (("kvferry_room", room), ("kvferry_addrs", addrs)):
        if value is not None or rng.random() < 0.5:
            params[key] = value
    return params


def finish(decode: Side, ids: set[str], deadline: float) -> None:
    end = time.monotonic() + deadline
    while not ids <= decode.outputs.keys():
        assert time.monotonic() < end, f"still waiting: {ids - decode.outputs.keys()}"
        decode.step()
        time.sleep(0.002)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_any_malformed_params_end_in_a_load_failure_and_the_engine_keeps_serving(seed, caplog):
    decode = Side("kv_consumer", free_port())
    rng = random.Random(seed)
    try:
        shape = kv_shape(decode.config)
        sent = {}
        with caplog.at_level(logging.ERROR, logger="kvferry.vllm"):
            for i in range(24):
                params = bad_params(shape, rng)
                sent[f"bad{i}"] = params
                decode.add(f"bad{i}", prompt_of(i, 40 + i), 2, dict(params))
            # Every one ends promptly: refused where it entered, recomputed by vLLM.
            finish(decode, set(sent), deadline=20)
        assert set(sent) <= decode.load_failures, {k: sent[k] for k in set(sent) - decode.load_failures}
        # No exception was raised anywhere in the connector (one in a worker thread is
        # logged with its traceback).
        assert "Traceback" not in caplog.text, caplog.text
        # The engine still serves: a plain request and more garbage after it.
        decode.add("plain", prompt_of(99, 50), 2, None)
        finish(decode, {"plain"}, deadline=10)
        deadline = time.monotonic() + 20
        while not decode.idle() and time.monotonic() < deadline:
            decode.step()
        assert decode.idle(), "a refused request kept its blocks"
    finally:
        decode.shutdown()


def test_malformed_params_of_a_request_aborted_before_it_ran_are_let_go(caplog):
    """A request that ends before vLLM schedules it asks its prefill to free the room: with
    params that name none, that is skipped, and nothing raises in the scheduler."""
    from vllm.v1.request import RequestStatus

    decode = Side("kv_consumer", free_port())
    try:
        shape = kv_shape(decode.config)
        for i, addrs in enumerate(BAD_ADDRS):
            params = {"do_remote_prefill": True, "kvferry_shape": shape,
                      "kvferry_room": 5 + i, "kvferry_addrs": addrs}
            decode.add(f"a{i}", prompt_of(i, 40), 2, params)
            decode.scheduler.finish_requests(f"a{i}", RequestStatus.FINISHED_ABORTED)
        decode.add("after", prompt_of(7, 40), 2, None)
        finish(decode, {"after"}, deadline=10)
    finally:
        decode.shutdown()


def _idle_prefill_and_params(lease_s: float):
    """A prefill engine that computed one prompt for a decode, then stopped stepping (vLLM
    does not step an engine with nothing to run); its params."""
    prefill = Prefill(free_port(), extra={"lease_s": lease_s})
    prompt = prompt_of(5, 100)
    prefill.prefill("p", prompt)
    rid, params = prefill.params()
    # One more step hands the finished request's room to the worker, as vLLM's does.
    time.sleep(0.2)
    prefill.pause()
    return prefill, prompt, params


def _refused_within_a_second(prefill, prompt: list[int], params: dict) -> None:
    """A fresh decode loading ``params`` fails the load within 1.5 s; both engines end."""
    decode = Side("kv_consumer", free_port())
    try:
        start = time.monotonic()
        decode.add("d", prompt, 2, dict(params))
        finish(decode, {"d"}, deadline=10)
        took = time.monotonic() - start
        assert "d" in decode.load_failures
        assert took < 1.5, f"the refusal took {took:.2f} s"
    finally:
        decode.shutdown()
        prefill.kill()


def test_an_idle_prefill_refuses_a_room_it_never_handed_out_within_a_second():
    prefill, prompt, params = _idle_prefill_and_params(lease_s=30)
    # The prefill's prefix, an id it never made (its tag cannot check out).
    forged = dict(params, kvferry_room=params["kvferry_room"] ^ 1)
    _refused_within_a_second(prefill, prompt, forged)


def test_an_idle_prefill_refuses_a_room_whose_lease_ran_out_within_a_second():
    prefill, prompt, params = _idle_prefill_and_params(lease_s=1)
    time.sleep(1.5)  # the lease runs out while the engine does not step
    _refused_within_a_second(prefill, prompt, params)


@pytest.mark.parametrize("length", [100, 60], ids=["same-length", "shorter"])
def test_a_room_handed_to_another_prompt_is_refused_and_that_prompt_recomputed(length, caplog):
    """A router hands prompt A's fresh params to a request for prompt B: B never loads A's
    KV (refused as prompt_mismatch within a round trip), B's blocks hold B's own KV after
    vLLM recomputes it, and the prefill frees A's blocks."""
    from vllm.v1.request import RequestStatus

    prefill = Prefill(free_port())
    decode = Side("kv_consumer", free_port())
    try:
        a = prompt_of(5, 100)
        prefill.prefill("a", a)
        _, params = prefill.params()
        b = prompt_of(6, length)
        checked = None
        start = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="kvferry.vllm"):
            decode.add("b", b, 3, dict(params))
            while "b" not in decode.outputs:
                assert time.monotonic() - start < 20, "the swapped request still waits"
                decode.step()
                req = decode.scheduler.requests.get("b")
                if (checked is None and req is not None and req.status == RequestStatus.RUNNING
                        and req.num_computed_tokens >= len(b)):
                    checked = decode.check_blocks("b", b)
                time.sleep(0.002)
        assert "b" in decode.load_failures
        assert "prompt_mismatch" in caplog.text, caplog.text
        assert checked == -(-length // 32), "b's blocks were not checked against its own prompt"
    finally:
        decode.shutdown()
        assert prefill.stop(), "the prefill still holds the swapped room's blocks"


def router_plan(params: dict[str, dict], shape: dict, rng: random.Random) -> dict[str, tuple[str, dict]]:
    """What a router (or a bug in one) hands each decode request: its own params, another
    request's (the two swapped, so no room is asked for twice), one field of its own
    perturbed, or garbage; with the kind drawn."""
    plan: dict[str, tuple[str, dict]] = {}
    ids = list(params)
    rng.shuffle(ids)
    for req_id in ids:
        if req_id in plan:
            continue
        own = params[req_id]
        kind = rng.choice(["own", "own", "swapped", "room-bit", "other-port", "shape", "garbage"])
        free = [o for o in ids if o not in plan and o != req_id]
        if kind == "swapped" and free:
            other = rng.choice(free)
            plan[req_id] = ("swapped", dict(params[other]))
            plan[other] = ("swapped", dict(own))
            continue
        p = dict(own)
        if kind == "swapped":
            kind = "own"
        elif kind == "room-bit":
            p["kvferry_room"] = own["kvferry_room"] ^ (1 << rng.randrange(64))
        elif kind == "other-port":
            host, _, _ = own["kvferry_addrs"][0].rpartition(":")
            p["kvferry_addrs"] = [f"{host}:{free_port()}"]
        elif kind == "shape":
            p["kvferry_shape"] = dict(shape, num_layers=shape["num_layers"] + 1)
        elif kind == "garbage":
            p = bad_params(shape, rng)
        plan[req_id] = (kind, p)
    return plan


@pytest.mark.parametrize("seed", [11, 12])
def test_valid_perturbed_and_garbage_params_load_a_requests_own_kv_or_fail_the_load(seed):
    """Twelve prompts computed by a prefill; each decode request gets what a router (or a
    bug in one) might hand it. Every request ends within its deadline; one that loaded holds
    exactly its own prompt's KV (every byte checked); the others failed the load and were
    recomputed; the decode's blocks are all free at the end, and so are the prefill's once
    the rooms no decode asked for outlive their lease."""
    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    prefill = Prefill(free_port(), extra={"lease_s": 3})
    decode = Side("kv_consumer", free_port(), extra={"unreachable_timeout_ms": 2000})
    try:
        shape = kv_shape(decode.config)
        prompts = {f"q{i}": prompt_of(20 + i, 40 + 13 * i) for i in range(12)}
        for req_id, prompt in prompts.items():
            prefill.prefill(req_id, prompt)
        params = dict(prefill.params() for _ in prompts)
        plan = router_plan(params, shape, rng)
        kinds = {r: kind for r, (kind, _) in plan.items()}
        checked = {}
        for req_id, prompt in prompts.items():
            decode.add(req_id, prompt, 3, dict(plan[req_id][1]))
        end = time.monotonic() + 30
        while not prompts.keys() <= decode.outputs.keys():
            assert time.monotonic() < end, f"still waiting: {prompts.keys() - decode.outputs.keys()} {kinds}"
            decode.step()
            for req_id, prompt in prompts.items():
                req = decode.scheduler.requests.get(req_id)
                if (req_id not in checked and req is not None and req.status == RequestStatus.RUNNING
                        and req.num_computed_tokens >= len(prompt)):
                    # Loaded or recomputed, the blocks hold this request's own prompt's KV.
                    checked[req_id] = decode.check_blocks(req_id, prompt)
            time.sleep(0.002)
        assert checked.keys() == prompts.keys(), kinds
        loaded = prompts.keys() - decode.load_failures
        assert {kinds[r] for r in loaded} <= {"own"}, {r: kinds[r] for r in loaded}
        assert all(kinds[r] != "own" for r in decode.load_failures), {r: kinds[r] for r in decode.load_failures}
        deadline = time.monotonic() + 20
        while not decode.idle() and time.monotonic() < deadline:
            decode.step()
        assert decode.idle(), "a request kept its blocks"
    finally:
        decode.shutdown()
    time.sleep(4)  # the lease of rooms no decode asked for
    assert prefill.stop(), "the prefill still holds blocks"
