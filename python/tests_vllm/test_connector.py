"""kvferry's vLLM connector driven by vLLM's own scheduler, in two processes: a prefill engine
(vLLM ``Scheduler`` + the connector's worker half over real KV tensors) in a child process,
a decode engine in the test's. Every byte of every transferred block is checked."""

from __future__ import annotations

import logging
import queue
import secrets
import socket
import time

import pytest

from harness import Side, assert_data_path, mp_context, pattern

from kvferry.vllm import PUSH_BIT


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _prefill_main(port: int, kw: dict, inbox, outbox) -> None:
    """The prefill engine: takes prompts, prefills them as vLLM schedules them (chunked),
    and hands back each finished request's kv_transfer_params."""
    side = Side("kv_producer", port, **kw)
    outbox.put(("ready", None))
    stepping = True
    while True:
        try:
            while True:
                cmd = inbox.get_nowait()
                if cmd[0] == "stop":
                    chunks = side.worker.push_chunks()
                    side.shutdown()
                    outbox.put(("stopped", (side.idle(), chunks)))
                    return
                if cmd[0] == "pause":
                    # As vLLM leaves an engine with no request: no step at all.
                    stepping = False
                    outbox.put(("paused", None))
                    continue
                if cmd[0] == "idle":
                    outbox.put(("idle", side.idle()))
                    continue
                if cmd[0] == "paths":
                    outbox.put(("paths", side.worker.session_paths()))
                    continue
                if cmd[0] == "stats":
                    stats = side.transfer_stats
                    outbox.put(("stats", stats.to_dict() if stats is not None else None))
                    continue
                if cmd[0] == "preempt":
                    req = side.scheduler.requests.get(cmd[1])
                    if req is not None and req in side.scheduler.running:
                        side.scheduler.running.remove(req)
                        side.scheduler._preempt_request(req, time.monotonic())
                        outbox.put(("preempted", cmd[1]))
                    else:
                        outbox.put(("preempted", None))
                    continue
                if cmd[0] == "abort":
                    from vllm.v1.request import RequestStatus

                    side.scheduler.finish_requests(cmd[1], RequestStatus.FINISHED_ABORTED)
                    continue
                _, req_id, prompt, params = cmd
                side.add(req_id, prompt, 1, params)
        except queue.Empty:
            pass
        for o in side.step() if stepping else ():
            outbox.put(("params", (o.request_id, o.kv_transfer_params)))
        time.sleep(0.001)


class Prefill:
    """The child process running the prefill engine."""

    def __init__(self, port: int, **kw):
        ctx = mp_context()
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_prefill_main, args=(port, kw, self.inbox, self.outbox), daemon=True)
        self.proc.start()
        # Seconds here; minutes in the emulated RDMA guest, where building the engine imports
        # vLLM's tracing stack anew. A child that died says so at once.
        deadline = time.monotonic() + 600
        while True:
            assert self.proc.is_alive(), "the prefill engine died while starting"
            assert time.monotonic() < deadline, "the prefill engine did not start"
            try:
                kind, _ = self.outbox.get(timeout=1)
                break
            except queue.Empty:
                pass
        assert kind == "ready"
        self.early: list = []

    def prefill(self, req_id: str, prompt: list[int], remote: bool = True, room: int | None = None) -> None:
        """Computes ``prompt``: for a remote decode (it keeps the blocks for the room) unless
        ``remote`` is false; in push mode toward the router's ``room`` when one is given."""
        params = {"do_remote_decode": True} if remote else None
        if room is not None:
            params = dict(params, kvferry_push=True, kvferry_room=room)
        self.inbox.put(("add", req_id, prompt, params))

    def abort(self, req_id: str) -> None:
        self.inbox.put(("abort", req_id))

    def wait_idle(self, timeout: float) -> bool:
        """Whether the engine comes to hold no request (every block released) in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.inbox.put(("idle",))
            while True:
                kind, value = self.outbox.get(timeout=30)
                if kind == "idle":
                    break
                self.early.append((kind, value))
            if value:
                return True
            time.sleep(0.1)
        return False

    def session_paths(self) -> list:
        """The data path of each session of the engine's kvferry node."""
        self.inbox.put(("paths",))
        while True:
            kind, value = self.outbox.get(timeout=30)
            if kind == "paths":
                return value
            self.early.append((kind, value))

    def transfer_stats(self) -> dict | None:
        """What the engine's worker reported through vLLM's connector stats so far."""
        self.inbox.put(("stats",))
        while True:
            kind, value = self.outbox.get(timeout=30)
            if kind == "stats":
                return value
            self.early.append((kind, value))

    def pause(self) -> None:
        """Stops stepping the engine, as vLLM does when it holds no request to run."""
        self.inbox.put(("pause",))
        while True:
            kind, value = self.outbox.get(timeout=30)
            if kind == "paused":
                return
            self.early.append((kind, value))

    def preempt(self, req_id: str) -> bool:
        """Preempts a running request as vLLM does under memory pressure (its blocks go
        back at once); whether it was running."""
        self.inbox.put(("preempt", req_id))
        while True:
            kind, value = self.outbox.get(timeout=30)
            if kind == "preempted":
                return value == req_id
            self.early.append((kind, value))

    def params(self, timeout: float = 60) -> tuple[str, dict]:
        if self.early:
            kind, value = self.early.pop(0)
        else:
            kind, value = self.outbox.get(timeout=timeout)
        assert kind == "params", kind
        return value

    def stop(self) -> bool:
        """Stops the engine; whether it held no request any more (every block released)."""
        self.inbox.put(("stop",))
        while True:
            kind, value = self.outbox.get(timeout=30)
            if kind == "stopped":
                self.proc.join(timeout=10)
                self.chunks = value[1]
                return value[0]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()


def prompt_of(i: int, n: int) -> list[int]:
    return [(i * 37 + k * 11) % 997 + 3 for k in range(n)]


def run_decode(decode: Side, requests: dict[str, tuple[list[int], dict]], deadline: float = 60,
               held: int = 0) -> dict:
    """Adds each request to the decode with its prefill's params and steps until all finish;
    checks every prompt block from block ``held`` (those before it the decode holds itself)
    once the request runs on loaded KV. Returns the prompt's blocks of each request."""
    from vllm.v1.request import RequestStatus

    for req_id, (prompt, params) in requests.items():
        decode.add(req_id, prompt, 3, dict(params))
    checked = {}
    end = time.monotonic() + deadline
    while len(decode.outputs.keys() & requests.keys()) < len(requests):
        assert time.monotonic() < end, f"decode still waits: {decode.scheduler.get_request_counts()}"
        decode.step()
        for req_id, (prompt, _) in requests.items():
            req = decode.scheduler.requests.get(req_id)
            if (req is not None and req_id not in checked and req.status == RequestStatus.RUNNING
                    and req_id not in decode.load_failures):
                checked[req_id] = decode.check_blocks(req_id, prompt, held)
        time.sleep(0.002)
    return checked


@pytest.fixture
def ports():
    return free_port(), free_port()


def test_rooms_move_through_vllms_scheduler_with_every_byte_checked(ports):
    prefill = Prefill(ports[0])
    decode = Side("kv_consumer", ports[1])
    try:
        # Prompts from under a block to several chunks of the 64-token budget.
        lengths = [5, 32, 33, 64, 100, 150, 200, 257]
        prompts = {f"r{i}": prompt_of(i, n) for i, n in enumerate(lengths)}
        # Sequentially, then all at once.
        for req_id, prompt in list(prompts.items())[:3]:
            prefill.prefill(req_id, prompt)
            rid, params = prefill.params()
            assert params["do_remote_prefill"] and "kvferry_room" in params
            checked = run_decode(decode, {rid: (prompt, params)})
            assert checked == {rid: -(-len(prompt) // 32)}
        rest = dict(list(prompts.items())[3:])
        for req_id, prompt in rest.items():
            prefill.prefill(req_id, prompt)
        got = dict(prefill.params() for _ in rest)
        checked = run_decode(decode, {r: (rest[r], got[r]) for r in rest})
        assert checked == {r: -(-len(p) // 32) for r, p in rest.items()}
        assert not decode.load_failures
        assert_data_path(decode.worker.session_paths(), received=True)
        assert_data_path(prefill.session_paths(), received=False)
        # Every prefill request's blocks were released once its room ended.
        deadline = time.monotonic() + 20
        while not decode.idle() and time.monotonic() < deadline:
            decode.step()
        assert decode.idle()
    finally:
        decode.shutdown()
        assert prefill.stop(), "the prefill still holds requests (blocks never released)"


def test_the_check_catches_a_shifted_block(ports):
    """The byte check can fail: the decode's blocks shifted by one are caught."""
    prefill = Prefill(ports[0])
    decode = Side("kv_consumer", ports[1])
    try:
        prompt = prompt_of(1, 100)
        prefill.prefill("s", prompt)
        rid, params = prefill.params()
        run_decode(decode, {rid: (prompt, params)})
        # The same bytes, one block later: the check must refuse them.
        decode.add("shifted", prompt, 3, None)
        decode.step()
        got = decode.blocks_of("shifted")
        for index in range(1, 4):
            for layer in range(2):
                decode.block_bytes_of(got[index], layer).copy_(
                    pattern(prompt, index - 1, layer, decode.block_bytes))
        # (block 0 and the partial last block keep what the decode computed)
        with pytest.raises(AssertionError, match="differs"):
            decode.check_blocks("shifted", prompt)
    finally:
        decode.shutdown()
        prefill.stop()


def test_a_block_size_mismatch_is_refused_naming_both_values(ports, caplog):
    prefill = Prefill(ports[0], block_size=32)
    decode = Side("kv_consumer", ports[1], block_size=64)
    try:
        prompt = prompt_of(2, 100)
        prefill.prefill("m", prompt)
        rid, params = prefill.params()
        with caplog.at_level(logging.ERROR, logger="kvferry.vllm"):
            run_decode(decode, {rid: (prompt, params)})
        assert rid in decode.load_failures
        said = caplog.text
        assert "block_size: prefill 32, decode 64" in said, said

        # vLLM recomputed it: the request finished all the same.
        assert decode.outputs[rid].finish_reason is not None
    finally:
        decode.shutdown()
        prefill.stop()


def test_a_killed_prefill_fails_the_load_within_the_deadline_and_decode_recomputes(ports):
    prefill = Prefill(ports[0])
    decode = Side("kv_consumer", ports[1])
    try:
        prompt = prompt_of(3, 150)
        prefill.prefill("k", prompt)
        rid, params = prefill.params()
        prefill.kill()
        start = time.monotonic()
        run_decode(decode, {rid: (prompt, params)}, deadline=30)
        took = time.monotonic() - start
        assert rid in decode.load_failures
        assert took < 15, f"the failed load took {took:.1f} s"
        # vLLM's connector stats count the failure under kvferry's reason.
        reduced = decode.transfer_stats.reduce()
        assert reduced["kvferry_rooms_failed"] == 1, reduced
        assert reduced["kvferry_rooms_succeeded"] == 0, reduced
        assert sum(n for k, n in reduced.items() if k.startswith("kvferry_failed_")) == 1, reduced
    finally:
        decode.shutdown()


def test_a_decode_request_aborted_mid_room_keeps_its_blocks_until_no_write_can_land(ports):
    from vllm.v1.request import RequestStatus

    prefill = Prefill(ports[0])
    decode = Side("kv_consumer", ports[1])
    try:
        prompt = prompt_of(4, 200)
        prefill.prefill("a", prompt)
        rid, params = prefill.params()
        decode.add(rid, prompt, 3, dict(params))
        decode.step()
        req = decode.scheduler.requests[rid]
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        decode.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        # vLLM holds the blocks until the connector says the room is over.
        deadline = time.monotonic() + 20
        while rid in decode.scheduler.requests and time.monotonic() < deadline:
            decode.step()
            time.sleep(0.005)
        assert rid not in decode.scheduler.requests
        assert decode.idle()
        # The blocks went back to the pool and serve the next request, whose bytes are exact.
        prefill.prefill("b", prompt_of(5, 200))
        rid2, params2 = prefill.params()
        checked = run_decode(decode, {rid2: (prompt_of(5, 200), params2)})
        assert checked == {rid2: 7}
    finally:
        decode.shutdown()
        prefill.stop()


def push_params(room: int, kv_port: int) -> dict:
    """What a push-mode router tells the decode: the room it drew and the prefill's node."""
    return {"do_remote_prefill": True, "kvferry_push": True, "kvferry_room": room,
            "kvferry_addrs": [f"127.0.0.1:{kv_port}"]}


def push_rooms(prefill: "Prefill", decode: Side, prompts: dict[str, list[int]], kv_port: int) -> dict:
    """Pushes each prompt through a router's room: for every other one the decode asks first
    (its room waits at the prefill for the request), for the rest the prefill starts first.
    Steps until every request finished and checks each push room succeeded; returns the
    blocks checked of the requests the prefill started first (``run_decode``)."""
    rooms = {r: PUSH_BIT | secrets.randbits(32) for r in prompts}
    requests = {}
    for i, (req_id, prompt) in enumerate(prompts.items()):
        params = push_params(rooms[req_id], kv_port)
        if i % 2 == 0:
            decode.add(req_id, prompt, 3, params)
            decode.step()
            prefill.prefill(req_id, prompt, room=rooms[req_id])
        else:
            prefill.prefill(req_id, prompt, room=rooms[req_id])
            requests[req_id] = (prompt, params)
    checked = run_decode(decode, requests)
    while len(decode.outputs.keys() & prompts.keys()) < len(prompts):
        decode.step()
    got = dict(prefill.params() for _ in prompts)
    assert all(p["kvferry_push"] for p in got.values()), got
    assert not decode.load_failures, decode.load_failures
    assert checked == {r: -(-len(prompts[r]) // 32) for r in requests}
    return checked


def test_push_rooms_move_layer_by_layer_with_every_byte_checked(ports):
    """The router draws the room and tells both sides at once: the prefill sends each step's
    blocks layer by layer as its forward pass writes them (chunked: 257 tokens take five
    steps of 64), whether the decode asked before the prefill started or after."""
    prefill = Prefill(ports[0])
    decode = Side("kv_consumer", ports[1])
    try:
        lengths = [5, 64, 100, 257, 200, 33]
        push_rooms(prefill, decode, {f"p{i}": prompt_of(10 + i, n) for i, n in enumerate(lengths)}, ports[0])
        assert_data_path(decode.worker.session_paths(), received=True)
        assert_data_path(prefill.session_paths(), received=False)
    finally:
        decode.shutdown()
        assert prefill.stop(), "the prefill still holds requests (blocks never released)"
    # The rooms the decode asked for first went out layer by layer with the forward pass.
    assert prefill.chunks["layerwise"] > 0, prefill.chunks


def test_push_rooms_deliver_every_block_exactly(ports):
    """Every byte of push rooms checked on the decode, the decode asking first."""
    prefill = Prefill(ports[0])
    decode = Side("kv_consumer", ports[1])
    try:
        from vllm.v1.request import RequestStatus

        prompt = prompt_of(42, 257)
        room = PUSH_BIT | secrets.randbits(32)
        decode.add("x", prompt, 3, push_params(room, ports[0]))
        decode.step()
        prefill.prefill("x", prompt, room=room)
        deadline = time.monotonic() + 30
        while decode.scheduler.requests["x"].status != RequestStatus.RUNNING:
            assert time.monotonic() < deadline
            decode.step()
            time.sleep(0.002)
        assert decode.check_blocks("x", prompt) == 9
        prefill.params()
    finally:
        decode.shutdown()
        assert prefill.stop()


def test_an_aborted_push_prefill_fails_the_decode_room_and_frees_its_blocks(ports):
    prefill = Prefill(ports[0], max_num_batched_tokens=32)
    decode = Side("kv_consumer", ports[1])
    try:
        prompt = prompt_of(7, 1800)  # 57 steps of 32 tokens
        room = PUSH_BIT | secrets.randbits(32)
        decode.add("q", prompt, 3, push_params(room, ports[0]))
        decode.step()
        prefill.prefill("q", prompt, room=room)
        time.sleep(0.03)
        prefill.abort("q")
        deadline = time.monotonic() + 20
        while "q" not in decode.outputs:
            assert time.monotonic() < deadline, "the decode still waits"
            decode.step()
            time.sleep(0.002)
        assert "q" in decode.load_failures, (decode.loaded, decode.outputs["q"])
    finally:
        decode.shutdown()
        assert prefill.stop(), "the aborted request's blocks were never released"


def test_a_push_prefill_preempted_mid_room_fails_the_room_before_its_blocks_are_reused(ports):
    """vLLM takes a running request's blocks back when it preempts it: the push room fails
    before any of them is overwritten (the decode recomputes), and the resumed request
    finishes for no room."""
    prefill = Prefill(ports[0], max_num_batched_tokens=32)
    decode = Side("kv_consumer", ports[1])
    try:
        prompt = prompt_of(8, 1800)
        room = PUSH_BIT | secrets.randbits(32)
        decode.add("v", prompt, 3, push_params(room, ports[0]))
        decode.step()
        prefill.prefill("v", prompt, room=room)
        time.sleep(0.03)
        assert prefill.preempt("v"), "the request was no longer running"
        deadline = time.monotonic() + 30
        while "v" not in decode.outputs:
            assert time.monotonic() < deadline, "the decode still waits"
            decode.step()
            time.sleep(0.002)
        assert "v" in decode.load_failures
        prefill.params()  # the resumed request finished
    finally:
        decode.shutdown()
        assert prefill.stop(), "the preempted request's blocks were never released"


def test_a_decode_request_aborted_before_it_was_scheduled_releases_the_prefills_blocks(ports):
    from vllm.v1.request import RequestStatus

    prefill = Prefill(ports[0])
    decode = Side("kv_consumer", ports[1])
    try:
        prompt = prompt_of(9, 150)
        prefill.prefill("z", prompt)
        rid, params = prefill.params()
        decode.add(rid, prompt, 3, dict(params))
        decode.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        for _ in range(20):
            decode.step()
            time.sleep(0.01)
        assert decode.idle()
        assert prefill.wait_idle(10), "the prefill still holds the abandoned room's blocks"
    finally:
        decode.shutdown()
        prefill.stop()


def test_a_prefill_left_idle_is_let_go_and_named_again_for_its_next_request(ports):
    """A producer no request used for ``peer_idle_timeout_ms`` is let go by the consumer (no
    session kept, nothing dialed); the next request routed to it names it again and loads."""
    prefill = Prefill(ports[0])
    decode = Side("kv_consumer", ports[1], extra={"peer_idle_timeout_ms": 300})
    node = decode.worker._worker.node
    try:
        for i, wait in enumerate([1.0, 0.0]):
            prompt = prompt_of(i, 40)
            prefill.prefill(f"r{i}", prompt)
            rid, params = prefill.params()
            assert run_decode(decode, {rid: (prompt, params)}) == {rid: 2}
            time.sleep(wait)
            if wait:
                assert node.counters()["peers_let_go"] == 1
        assert not decode.load_failures
        assert len(decode.worker._worker._peers) == 1, "the name let go was dropped"
    finally:
        decode.shutdown()
        prefill.stop()


def test_a_room_toward_a_prefill_already_contacted_opens_in_the_step_that_scheduled_it(ports):
    """The first room toward a prefill opens off vLLM's step (its first contact may wait up to
    ``unreachable_timeout``); the next ones open in the step itself, with no hand-off to
    another thread, until the prefill is let go and has to be contacted again."""
    prefill = Prefill(ports[0])
    decode = Side("kv_consumer", ports[1], extra={"peer_idle_timeout_ms": 300})
    worker = decode.worker._worker
    off_step, in_step = [], {}
    submit, open_recv = worker._submit, worker._open_recv

    def opened(req_id, recv):
        open_recv(req_id, recv)
        in_step[req_id] = recv.opened

    worker._submit = lambda work, *args: (off_step.append(work.__name__), submit(work, *args))
    worker._open_recv = opened
    try:
        for i, wait in enumerate([0.0, 1.0, 0.0]):
            prompt = prompt_of(i, 40)
            prefill.prefill(f"r{i}", prompt)
            rid, params = prefill.params()
            decode.add(rid, prompt, 3, dict(params))
            end = time.monotonic() + 60
            while rid not in decode.outputs:
                assert time.monotonic() < end, f"decode still waits: {decode.scheduler.get_request_counts()}"
                decode.step()
            if i == 1:
                assert in_step[rid] and off_step == [], "opened in the step"
            else:
                assert off_step == ["_open_now"], f"{rid}: opened off the step for a first contact"
            off_step.clear()
            time.sleep(wait)
        assert worker.node.counters()["peers_let_go"] == 1
        assert not decode.load_failures
    finally:
        decode.shutdown()
        prefill.stop()


def test_rooms_are_reported_through_vllms_connector_stats_and_prometheus_metrics(ports):
    """The model runner hands vLLM each step's stats: rooms, bytes and transfer times reach its
    loggers (``reduce``) and ``/metrics`` (the connector's Prometheus metrics) on both sides."""
    import functools

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvferry.vllm import KvferryConnector

    prefill = Prefill(ports[0])
    decode = Side("kv_consumer", ports[1])
    try:
        prompts = {f"s{i}": prompt_of(40 + i, n) for i, n in enumerate([33, 64, 100])}
        for req_id, prompt in prompts.items():
            prefill.prefill(req_id, prompt)
        got = dict(prefill.params() for _ in prompts)
        run_decode(decode, {r: (prompts[r], got[r]) for r in prompts})
        blocks = sum(-(-len(p) // 32) for p in prompts.values())
        from harness import LAYERS

        block_bytes = decode.block_bytes * LAYERS
        reduced = decode.transfer_stats.reduce()
        assert reduced["kvferry_rooms_succeeded"] == 3, reduced
        assert reduced["kvferry_rooms_failed"] == 0, reduced
        assert reduced["kvferry_bytes"] == blocks * block_bytes, (reduced, blocks, block_bytes)
        assert reduced["kvferry_transfer_ms_avg"] > 0
        # The prefill's worker counts the rooms it sent, once each decode's room ended.
        deadline = time.monotonic() + 20
        sent = None
        while time.monotonic() < deadline:
            sent = prefill.transfer_stats()
            if sent and sent["succeeded"] == 3:
                break
            time.sleep(0.1)
        assert sent is not None and sent["succeeded"] == 3 and sent["bytes"] == blocks * block_bytes, sent
        # vLLM builds the stats from the plain data its workers send, and aggregates them.
        rebuilt = KvferryConnector.build_kv_connector_stats(decode.transfer_stats.to_dict())
        both = rebuilt.aggregate(KvferryConnector.build_kv_connector_stats(sent))
        assert both.reduce()["kvferry_rooms_succeeded"] == 6
        # And its Prometheus logger observes the data per engine.
        registry = CollectorRegistry()
        types = {k: functools.partial(k, registry=registry) for k in (Counter, Gauge, Histogram)}
        metrics = KvferryConnector.build_prom_metrics(
            decode.config, types, ["model_name", "engine"], {0: ["tiny", "0"]}
        )
        metrics.observe(decode.transfer_stats.to_dict(), 0)
        labels = {"model_name": "tiny", "engine": "0"}
        assert registry.get_sample_value("vllm:kvferry_rooms_succeeded_total", labels) == 3
        assert registry.get_sample_value("vllm:kvferry_bytes_total", labels) == blocks * block_bytes
        assert registry.get_sample_value("vllm:kvferry_transfer_time_seconds_count", labels) == 3
        metrics.observe({"failed": 1, "failed_by_reason": {"peer_unreachable": 1}}, 0)
        assert registry.get_sample_value(
            "vllm:kvferry_rooms_failed_total", dict(labels, reason="peer_unreachable")
        ) == 1
    finally:
        decode.shutdown()
        assert prefill.stop()
