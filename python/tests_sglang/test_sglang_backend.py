"""kvferry as SGLang's transfer backend, driven through SGLang 0.5.23's own classes in the
order its prefill and decode schedulers call them: a prefill process (SGLang's bootstrap
server and a prefill rank) and a decode rank in the test process, numpy KV pools and SGLang's
MetadataBuffers as aux, every byte checked."""

import importlib.metadata
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import cluster
import roles

BOOTSTRAP_TIMEOUT_S = 3
DEADLINE_S = 30


def serve_prefill(bootstrap_port, commands, results, env):
    """A prefill scheduler, scripted: for each command it creates the room's sender, waits
    for the decode's pages as the bootstrap queue does, then sends the chunks."""
    os.environ.update(env)
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError

    roles.publish("prefill", bootstrap_port)  # installs kvferry before get_kv_class is imported
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    server_class = get_kv_class(TransferBackend("kvferry"), KVClassType.BOOTSTRAP_SERVER)
    server = server_class(host="127.0.0.1", port=bootstrap_port)
    rank = roles.Rank("prefill", bootstrap_port, kv_fill_seed=1)
    results.put(("ready", rank.manager.rank_port))
    addr = f"127.0.0.1:{bootstrap_port}"
    while True:
        cmd = commands.get()
        if cmd is None:
            break
        room, src_pages, chunks, aux_slot, mode = cmd
        sender = rank.sender_class(rank.manager, addr, room)
        started = time.monotonic()
        status = sender.poll()
        while status == KVPoll.Bootstrapping:
            time.sleep(0.005)
            status = sender.poll()
        if status == KVPoll.WaitingForInput:
            sender.init(len(src_pages), aux_slot)
            rank.write_aux(aux_slot, room)
            at = 0
            for i, n in enumerate(chunks):
                sender.send(np.array(src_pages[at : at + n], dtype=np.int32))
                at += n
                if mode == "die_after_first_chunk":
                    os.kill(os.getpid(), signal.SIGKILL)
                if mode == "hold_after_first_chunk":
                    break
            status = sender.poll()
            while status not in (KVPoll.Success, KVPoll.Failed):
                time.sleep(0.005)
                status = sender.poll()
        reason = None
        if status == KVPoll.Failed:
            try:
                sender.failure_exception()
            except KVTransferError as e:
                reason = str(e)
        else:
            sender.clear()
        metric = sender.get_transfer_metric()
        elapsed = time.monotonic() - started
        paths = cluster.session_paths(rank.manager)
        results.put((room, int(status), reason, elapsed, metric.transfer_total_bytes, paths))
    rank.manager.teardown()
    server.close()


@pytest.fixture
def prefill():
    yield from _prefill({})


@pytest.fixture
def prefill_with_short_bootstrap():
    yield from _prefill({"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT_S)})


def _prefill(env, port=None):
    ctx = cluster.mp_context()
    commands, results = ctx.Queue(), ctx.Queue()
    port = port or roles.free_port()
    proc = ctx.Process(target=serve_prefill, args=(port, commands, results, env))
    proc.start()
    end = time.monotonic() + 120
    while results.empty():
        assert proc.is_alive(), "the prefill process died while starting"
        assert time.monotonic() < end, "the prefill process did not start"
        time.sleep(0.05)
    tag, _rank_port = results.get()
    assert tag == "ready"
    yield proc, port, commands, results
    commands.put(None)
    proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()


@pytest.fixture
def decode(request):
    env = getattr(request, "param", {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    ranks = []

    def make(bootstrap_port):
        rank = roles.Rank("decode", bootstrap_port)
        ranks.append(rank)
        return rank

    yield make
    for rank in ranks:
        rank.manager.teardown()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def poll_until(receiver, states, deadline=DEADLINE_S):
    end = time.monotonic() + deadline
    status = receiver.poll()
    while status not in states:
        assert time.monotonic() < end, f"room still {status} after {deadline} s"
        time.sleep(0.005)
        status = receiver.poll()
    return status


def bootstrap(rank, port, room):
    """Decode's prealloc queue: parallel info, a receiver, init, until bootstrapped."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    addr = f"127.0.0.1:{port}"
    end = time.monotonic() + DEADLINE_S
    while not rank.manager.try_ensure_parallel_info(addr):
        assert time.monotonic() < end
        time.sleep(0.05)
    receiver = rank.receiver_class(rank.manager, addr, room)
    receiver.init(0)
    assert poll_until(receiver, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
    return receiver


def a_room_succeeds(rank, port, commands, results, room, src, chunks, dst, aux):
    """One room from prefill pages ``src`` (sent in ``chunks``) into decode pages ``dst`` and
    aux slot ``aux``: Success on both sides, every byte and the aux row checked."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    commands.put((room, src, chunks, aux, "send"))
    receiver = bootstrap(rank, port, room)
    receiver.send_metadata(np.array(dst, dtype=np.int32), aux)
    assert poll_until(receiver, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
    assert np.array_equal(rank.kv[:, dst, :], expected(src))
    assert rank.aux_matches(aux, room)
    sent = results.get(timeout=DEADLINE_S)
    assert sent[:3] == (room, KVPoll.Success, None)
    cluster.assert_data_path(sent[5], received=False)
    cluster.assert_data_path(cluster.session_paths(rank.manager), received=True)
    receiver.clear()


def expected(src_pages):
    src = np.zeros((2 * roles.LAYERS, roles.PAGES, roles.PAGE_BYTES), dtype=np.uint8)
    roles.fill(src, 1)
    return src[:, src_pages, :]


def test_rooms_move_through_sglang_classes_with_chunked_sends_and_every_byte_checked(prefill, decode):
    from sglang.srt.disaggregation.base.conn import KVPoll

    _proc, port, commands, results = prefill
    rank = decode(port)
    cases = [
        (101, [3, 4, 5, 6, 7], [2, 2, 1], [20, 21, 22, 23, 24], 1),
        (102, [9, 1], [2], [2, 30], 2),
        (2**62 + 7, [0, 31, 15, 16], [1, 1, 1, 1], [10, 11, 12, 13], 7),
    ]
    for room, src, chunks, dst, aux in cases:
        commands.put((room, src, chunks, 5, "send"))
        receiver = bootstrap(rank, port, room)
        receiver.send_metadata(np.array(dst, dtype=np.int32), aux)
        assert poll_until(receiver, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
        got_room, status, reason, _t, total_bytes, paths = results.get(timeout=DEADLINE_S)
        assert (got_room, status, reason) == (room, KVPoll.Success, None)
        assert total_bytes == len(src) * 2 * roles.LAYERS * roles.PAGE_BYTES
        assert np.array_equal(rank.kv[:, dst, :], expected(src))
        assert rank.aux_matches(aux, room)
        cluster.assert_data_path(paths, received=False)
        cluster.assert_data_path(cluster.session_paths(rank.manager), received=True)
        receiver.clear()
    written = {p for _r, _s, _c, dst, _a in cases for p in dst}
    untouched = [p for p in range(roles.PAGES) if p not in written]
    assert not rank.kv[:, untouched, :].any(), "a page nobody granted was written"


def test_a_decode_abort_mid_room_quarantines_the_pages_until_releasable_then_they_are_reused_intact(prefill, decode):
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError

    _proc, port, commands, results = prefill
    rank = decode(port)
    dst = [4, 5, 6, 7]
    commands.put((201, [1, 2, 3, 8], [1, 3], 0, "hold_after_first_chunk"))
    receiver = bootstrap(rank, port, 201)
    receiver.send_metadata(np.array(dst, dtype=np.int32), 0)
    receiver.abort()  # SGLang's AbortReq
    assert receiver.poll() == KVPoll.Failed
    with pytest.raises(KVTransferError, match="Aborted"):
        receiver.failure_exception()
    room, status, reason, _t, _b, _p = results.get(timeout=DEADLINE_S)
    assert (room, status) == (201, KVPoll.Failed)
    assert "aborted_by_peer" in reason
    end = time.monotonic() + DEADLINE_S
    while not rank.manager.is_abort_release_safe(201, 1):
        assert time.monotonic() < end, "pages of an aborted room never became releasable"
        time.sleep(0.01)
    # The same pages, reused for the next request, receive it intact.
    commands.put((202, [10, 11, 12, 13], [4], 3, "send"))
    receiver = bootstrap(rank, port, 202)
    receiver.send_metadata(np.array(dst, dtype=np.int32), 3)
    assert poll_until(receiver, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
    assert np.array_equal(rank.kv[:, dst, :], expected([10, 11, 12, 13]))
    assert rank.aux_matches(3, 202)
    assert results.get(timeout=DEADLINE_S)[:3] == (202, KVPoll.Success, None)


def test_a_prefill_room_no_decode_asks_for_fails_with_bootstrap_timeout_within_sglangs_deadline(prefill_with_short_bootstrap):
    from sglang.srt.disaggregation.base.conn import KVPoll

    _proc, _port, commands, results = prefill_with_short_bootstrap
    commands.put((301, [1], [1], 0, "send"))
    room, status, reason, elapsed, _b, _p = results.get(timeout=DEADLINE_S)
    assert (room, status) == (301, KVPoll.Failed)
    assert "bootstrap_timeout" in reason
    assert BOOTSTRAP_TIMEOUT_S - 0.5 <= elapsed <= BOOTSTRAP_TIMEOUT_S + 5


@pytest.mark.parametrize("decode", [{"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "3"}], indirect=True)
def test_a_decode_room_whose_prefill_never_sends_fails_with_a_timeout_not_a_hang(prefill, decode):
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError

    _proc, port, commands, _results = prefill
    rank = decode(port)
    receiver = bootstrap(rank, port, 401)  # no sender is ever made for room 401
    receiver.send_metadata(np.array([1, 2], dtype=np.int32), 0)
    started = time.monotonic()
    assert poll_until(receiver, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Failed
    assert time.monotonic() - started <= 3 + 5
    with pytest.raises(KVTransferError, match="timeout"):
        receiver.failure_exception()


def test_a_prefill_killed_mid_room_fails_the_decode_room_with_a_peer_reason_and_a_restarted_prefill_serves_the_next(prefill, decode):
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError

    proc, port, commands, _results = prefill
    rank = decode(port)
    commands.put((501, [1, 2, 3, 4], [2, 2], 0, "die_after_first_chunk"))
    receiver = bootstrap(rank, port, 501)
    receiver.send_metadata(np.array([5, 6, 7, 8], dtype=np.int32), 0)
    proc.join(timeout=DEADLINE_S)
    assert proc.exitcode == -signal.SIGKILL
    assert poll_until(receiver, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Failed
    receiver.abort()  # SGLang aborts rooms that already failed: no exception reaches it
    receiver.ensure_abort_notified(force_arm=True)
    with pytest.raises(KVTransferError) as failure:
        receiver.failure_exception()
    assert any(r in str(failure.value) for r in ("connection_lost", "peer_silent", "peer_unreachable", "peer_restarted")), str(failure.value)
    end = time.monotonic() + DEADLINE_S
    while not rank.manager.is_abort_release_safe(501, 1):
        assert time.monotonic() < end, "pages of a room whose prefill died never became releasable"
        time.sleep(0.01)
    receiver.clear()
    # The prefill comes back at the same bootstrap address (its kvferry port is new).
    restarted = _prefill({}, port)
    _proc, _port, commands, results = next(restarted)
    commands.put((502, [9, 10], [2], 1, "send"))
    receiver = bootstrap(rank, port, 502)
    receiver.send_metadata(np.array([5, 6], dtype=np.int32), 1)
    assert poll_until(receiver, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
    assert np.array_equal(rank.kv[:, [5, 6], :], expected([9, 10]))
    assert results.get(timeout=DEADLINE_S)[:3] == (502, KVPoll.Success, None)
    next(restarted, None)


def test_a_pool_with_a_state_type_kvferry_does_not_move_is_refused_naming_it():
    from kvferry.sglang.conn import UnsupportedLayout, _layout_of

    class Args:
        kv_data_ptrs, kv_data_lens, kv_item_lens = [1, 2], [4096, 4096], [1024, 1024]
        aux_data_ptrs, aux_data_lens, aux_item_lens = [], [], []
        state_types = ["mamba", "dsa_tail"]
        state_data_ptrs = [[3], [4]]

    with pytest.raises(UnsupportedLayout, match=r"state types \['dsa_tail'\]"):
        _layout_of(Args(), None, False, False)
    Args.state_types = ["mamba"]
    with pytest.raises(UnsupportedLayout, match="over 2 components"):
        _layout_of(Args(), None, False, False)
    Args.state_types, Args.state_data_ptrs, Args.kv_item_lens = [], [], [1024, 512]
    with pytest.raises(UnsupportedLayout, match="same page size"):
        _layout_of(Args(), None, False, False)


def test_sglangs_launcher_accepts_the_kvferry_backend_in_a_fresh_process_through_the_plugin_entry_point():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert "kvferry.sglang:install" in {ep.value for ep in eps}
    script = """
import argparse
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
ns = parser.parse_args(["--model-path", "dummy", "--disaggregation-transfer-backend", "kvferry"])
assert ns.disaggregation_transfer_backend == "kvferry"
backend = TransferBackend(ns.disaggregation_transfer_backend)
print(get_kv_class(backend, KVClassType.MANAGER).__name__)
from sglang.srt.managers import disagg_service
print(disagg_service.get_kv_class(backend, KVClassType.RECEIVER).__name__)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["KvferryKVManager", "KvferryKVReceiver"]


@pytest.mark.parametrize("decode", [{"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(BOOTSTRAP_TIMEOUT_S)}], indirect=True)
def test_a_decode_with_no_kv_capacity_for_a_room_fails_it_as_decode_saturated_on_both_sides(prefill, decode):
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError

    _proc, port, commands, results = prefill  # its own deadline is SGLang's default, 300 s
    rank = decode(port)
    commands.put((601, [1, 2], [2], 0, "send"))
    receiver = bootstrap(rank, port, 601)  # SGLang never finds pages for it: no send_metadata
    assert poll_until(receiver, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Failed
    with pytest.raises(KVTransferError, match="decode_saturated"):
        receiver.failure_exception()
    room, status, reason, _t, _b, _p = results.get(timeout=DEADLINE_S)
    assert (room, status) == (601, KVPoll.Failed)
    assert "decode_saturated" in reason


@pytest.mark.parametrize("decode", [{"KVFERRY_TRANSFER_RETRIES": "many"}], indirect=True)
def test_kvferry_knobs_reach_the_backend_and_a_bad_one_stops_the_rank_with_its_name(decode):
    import kvferry

    with pytest.raises(kvferry.InvalidArgument, match="KVFERRY_TRANSFER_RETRIES"):
        decode(roles.free_port())


def test_a_prefill_restarted_at_a_fixed_listen_port_serves_the_very_next_room(decode):
    """KVFERRY_LISTEN_PORT keeps a restarted prefill at the address decode knows: kvferry's
    persistent session reconnects by itself, and no request fails after the restart."""
    env = {"KVFERRY_LISTEN_PORT": str(roles.free_port())}
    first = _prefill(env)
    proc, port, commands, results = next(first)
    rank = decode(port)
    a_room_succeeds(rank, port, commands, results, 801, [1], [1], [2], 0)
    ((kvferry_addr,),) = rank.manager._peers.named()  # the prefill rank's kvferry listener
    assert kvferry_addr.endswith(f":{env['KVFERRY_LISTEN_PORT']}")
    proc.kill()  # idle: decode notices only through its kvferry session
    proc.join(timeout=DEADLINE_S)
    restarted = _prefill(env, port)
    _proc, _port, commands, results = next(restarted)
    a_room_succeeds(rank, port, commands, results, 802, [4, 5], [1, 1], [6, 7], 1)
    assert rank.manager._peers.named() == [(kvferry_addr,)], "the same kvferry peer, reconnected"
    next(restarted, None)


@pytest.mark.parametrize("decode", [{"KVFERRY_PEER_IDLE_TIMEOUT_MS": "300"}], indirect=True)
def test_a_prefill_left_idle_is_let_go_and_named_again_for_its_next_room(prefill, decode):
    """A prefill no room used for KVFERRY_PEER_IDLE_TIMEOUT_MS is let go (no session kept,
    nothing dialed); the next room routed to it names it again and succeeds."""
    _proc, port, commands, results = prefill
    rank = decode(port)
    a_room_succeeds(rank, port, commands, results, 821, [1], [1], [2], 0)
    (first,) = rank.manager._peers.named()
    time.sleep(1.0)
    assert rank.manager.node.counters()["peers_let_go"] == 1
    a_room_succeeds(rank, port, commands, results, 822, [3, 4], [2], [5, 6], 1)
    assert rank.manager._peers.named() == [first], "named again, the name let go dropped"


@pytest.mark.parametrize("decode", [{"KVFERRY_UNREACHABLE_TIMEOUT_MS": "1000"}], indirect=True)
def test_a_prefill_restarted_on_a_new_port_serves_the_very_next_room(decode):
    """Without KVFERRY_LISTEN_PORT a restarted prefill listens elsewhere: decode sees its kept
    peer down past its window, asks the bootstrap server again, and the very next room goes
    to the new address instead of failing connection_refused (and leaving the prefill's half
    of the request waiting for its bootstrap timeout)."""
    first = _prefill({})
    proc, port, commands, results = next(first)
    rank = decode(port)
    a_room_succeeds(rank, port, commands, results, 811, [1], [1], [2], 0)
    (old,) = rank.manager._peers.named()
    proc.kill()  # idle: decode notices only through its kvferry session
    proc.join(timeout=DEADLINE_S)
    restarted = _prefill({}, port)
    _proc, _port, commands, results = next(restarted)
    time.sleep(1.5)  # the old address has now been down past the decode's 1 s window
    a_room_succeeds(rank, port, commands, results, 812, [4, 5], [1, 1], [6, 7], 1)
    named = rank.manager._peers.named()
    assert old in named and len(named) == 2, named
    next(restarted, None)


def test_the_listener_binds_the_servers_host_unless_it_is_every_address():
    from kvferry.sglang.conn import listen_host

    assert listen_host("127.0.0.1", "10.0.0.5") == "127.0.0.1"
    assert listen_host("0.0.0.0", "10.0.0.5") == "10.0.0.5"
    assert listen_host("::", "10.0.0.5") == "10.0.0.5"
    assert listen_host(None, "10.0.0.5") == "10.0.0.5"
    assert listen_host("[::1]", "10.0.0.5") == "::1"


def test_a_bad_metrics_address_is_refused_naming_the_variable():
    import kvferry
    from kvferry.sglang.conn import metrics_addr

    assert metrics_addr(None, 2) is None
    assert metrics_addr("127.0.0.1:9400", 2) == "127.0.0.1:9402"
    for bad in ("9400", "localhost", "host:port", ":9400", "host:65535"):
        with pytest.raises(kvferry.InvalidArgument, match="KVFERRY_METRICS_ADDR"):
            metrics_addr(bad, 1)


def test_a_bad_listen_port_is_refused_naming_the_variable():
    import kvferry
    from kvferry.sglang.conn import listen_port

    assert listen_port(None, 3) == 0
    assert listen_port("", 3) == 0
    assert listen_port("40000", 3) == 40003
    with pytest.raises(kvferry.InvalidArgument, match="KVFERRY_LISTEN_PORT='forty'"):
        listen_port("forty", 0)
    with pytest.raises(kvferry.InvalidArgument, match="KVFERRY_LISTEN_PORT='65535'.*65536"):
        listen_port("65535", 1)
