"""The Python API end to end: a prefill process and a decode process over loopback, numpy
arrays as the KV pool, every byte checked."""

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

import kvferry
from kvferry import KVPoll

LAYOUT = dict(layers=2, planes=2, page_bytes=4096, pages=16, aux_bytes=64, slots=4)
REGIONS = LAYOUT["layers"] * LAYOUT["planes"]
TOKEN = b"pytest-token"


def pool(fill):
    """One array per KV region (pages x page_bytes), and the aux rows."""
    kv = np.zeros((REGIONS, LAYOUT["pages"], LAYOUT["page_bytes"]), dtype=np.uint8)
    aux = np.zeros((LAYOUT["slots"], LAYOUT["aux_bytes"]), dtype=np.uint8)
    if fill:
        for r in range(REGIONS):
            for p in range(LAYOUT["pages"]):
                kv[r, p, :] = (np.arange(LAYOUT["page_bytes"]) * (r + 3) + p * 7) % 251
        for s in range(LAYOUT["slots"]):
            aux[s, :] = (np.arange(LAYOUT["aux_bytes"]) + 100 + s) % 256
    return kv, aux


def node(role, kv, aux, **config):
    spans = [(kv[r].ctypes.data, kv[r].nbytes) for r in range(REGIONS)]
    return kvferry.Node(role, LAYOUT, spans, aux=(aux.ctypes.data, aux.nbytes), token=TOKEN, **config)


def prompt_tokens(room):
    """The token ids whose KV the test prefill holds for ``room``."""
    return [room, 1000 + room, 7]


def serve_prefill(addr_queue, stop, send):
    """A prefill that opens every room a decode asks for, bound to ``prompt_tokens(room)``,
    and sends source pages 1, 2, 3."""
    kv, aux = pool(fill=True)
    n = node("prefill", kv, aux)
    addr_queue.put(n.listen("127.0.0.1:0")[0])
    while not stop.is_set():
        a = n.next_announcement(timeout=0.1)
        if a is None:
            continue
        room, generation, _pages, _skip = a
        n.open_sender(room, generation, prompt=kvferry.prompt_digest(prompt_tokens(room)))
        if send.is_set():
            try:
                n.send_chunk(room, [1, 2, 3], last=True, aux_slot=2)
            except kvferry.RoomFailed:
                pass  # the decode refused or aborted it: nothing to send
    n.shutdown()


@pytest.fixture
def prefill():
    ctx = mp.get_context("spawn")
    addr_queue, stop, send = ctx.Queue(), ctx.Event(), ctx.Event()
    send.set()
    proc = ctx.Process(target=serve_prefill, args=(addr_queue, stop, send))
    proc.start()
    addr = addr_queue.get(timeout=30)
    yield proc, addr, send
    stop.set()
    proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()


def expected_pages():
    src_kv, src_aux = pool(fill=True)
    return src_kv[:, 1:4, :], src_aux[2]


def test_a_room_moves_from_a_prefill_process_with_every_byte_checked(prefill):
    _proc, addr, _send = prefill
    kv, aux = pool(fill=False)
    d = node("decode", kv, aux)
    peer = d.connect([addr])
    d.open_receiver(7, [peer], pages=[5, 6, 7], aux_slot=0)
    assert d.wait(7, 20.0) == KVPoll.Success
    assert d.poll(7) == KVPoll.Success and d.failure(7) is None
    want_kv, want_aux = expected_pages()
    assert np.array_equal(kv[:, 5:8, :], want_kv)
    assert np.array_equal(aux[0], want_aux)
    # Nothing outside the granted pages was written.
    assert not kv[:, :5, :].any() and not kv[:, 8:, :].any()
    d.shutdown()


def test_an_aborted_room_keeps_its_pages_until_releasable_and_they_are_reused_clean(prefill):
    _proc, addr, send = prefill
    send.clear()  # the prefill opens the room but sends nothing: it is in flight forever
    kv, aux = pool(fill=False)
    d = node("decode", kv, aux)
    peer = d.connect([addr])
    d.open_receiver(11, [peer], pages=[5, 6, 7], aux_slot=0)
    time.sleep(0.3)
    d.abort(11)
    assert d.poll(11) == KVPoll.Failed
    assert isinstance(d.failure(11), kvferry.AbortFailure)
    deadline = time.time() + 10
    while not d.releasable(11):
        assert time.time() < deadline, "the aborted room's pages were never released"
        time.sleep(0.02)
    # The pages are reused for the next room, which the prefill sends in full.
    kv[:, 5:8, :] = 0xEE
    send.set()
    d.open_receiver(12, [peer], pages=[5, 6, 7], aux_slot=0)
    assert d.wait(12, 20.0) == KVPoll.Success
    want_kv, _ = expected_pages()
    assert np.array_equal(kv[:, 5:8, :], want_kv)
    d.shutdown()


def test_a_killed_prefill_fails_the_room_with_a_peer_failure_within_its_deadline(prefill):
    proc, addr, send = prefill
    send.clear()
    kv, aux = pool(fill=False)
    d = node("decode", kv, aux, waiting_timeout_ms=5000, bootstrap_timeout_ms=5000)
    peer = d.connect([addr])
    d.open_receiver(21, [peer], pages=[1, 2], aux_slot=0)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    started = time.time()
    assert d.wait(21, 15.0) == KVPoll.Failed
    assert time.time() - started < 10
    failure = d.failure(21)
    assert isinstance(failure, kvferry.RoomFailed)
    assert isinstance(failure, (kvferry.PeerFailure, kvferry.TimeoutFailure)), failure
    d.shutdown()


def test_a_persistent_peer_named_without_reaching_it_is_reached_later(prefill):
    """connect_persistent(reach=False) returns at once, even toward an address nothing
    listens on; reach() then waits for the first contact, or fails once the peer stayed
    unreachable for the unreachable timeout."""
    _proc, addr, _send = prefill
    kv, aux = pool(fill=False)
    d = node("decode", kv, aux, unreachable_timeout_ms=1000)
    started = time.time()
    dead = d.connect_persistent(["127.0.0.1:9"], reach=False)
    assert time.time() - started < 0.5
    with pytest.raises(kvferry.PeerUnreachable) as unreachable:
        d.reach(dead)
    assert unreachable.value.args[0] in ("connection_refused", "peer_unreachable")
    assert time.time() - started < 5
    live = d.connect_persistent([addr], reach=False)
    d.reach(live)
    d.open_receiver(31, [live], pages=[4, 5, 6], aux_slot=1)
    assert d.wait(31, 10.0) == KVPoll.Success
    d.shutdown()


def test_a_disconnected_peer_is_let_go_and_its_id_is_refused(prefill):
    """disconnect() closes a peer's sessions and forgets it: a room toward it is refused,
    and a second disconnect too; a kept peer never reached is let go by the failing call."""
    _proc, addr, _send = prefill
    kv, aux = pool(fill=False)
    d = node("decode", kv, aux, unreachable_timeout_ms=500)
    peer = d.connect_persistent([addr])
    d.open_receiver(41, [peer], pages=[4, 5, 6], aux_slot=1)
    assert d.wait(41, 10.0) == KVPoll.Success
    d.disconnect(peer)
    with pytest.raises(kvferry.InvalidArgument):
        d.open_receiver(42, [peer], pages=[7], aux_slot=0)
    with pytest.raises(kvferry.InvalidArgument):
        d.disconnect(peer)
    with pytest.raises(kvferry.PeerUnreachable):
        d.connect_persistent(["127.0.0.1:9"])
    again = d.connect([addr])
    d.open_receiver(43, [again], pages=[8, 9, 10], aux_slot=2)
    assert d.wait(43, 10.0) == KVPoll.Success
    d.shutdown()


def test_a_decode_without_a_read_spin_moves_rooms_and_a_bad_spin_is_refused(prefill):
    """read_spin_us=0 reads each socket once before waiting on the poller; rooms still land
    whole. A spin that is no number, or past 1000 us, is refused at start."""
    _proc, addr, _send = prefill
    kv, aux = pool(fill=False)
    for bad in ("soon", 5000):
        with pytest.raises(kvferry.InvalidArgument, match="READ_SPIN_US"):
            node("decode", kv, aux, read_spin_us=bad)
    d = node("decode", kv, aux, read_spin_us=0)
    peer = d.connect([addr])
    d.open_receiver(51, [peer], pages=[4, 5, 6], aux_slot=1)
    assert d.wait(51, 10.0) == KVPoll.Success
    src, _ = pool(fill=True)
    for i, page in enumerate([4, 5, 6]):
        assert (kv[:, page, :] == src[:, 1 + i, :]).all()
    d.shutdown()


def test_bad_input_raises_the_documented_exceptions(prefill):
    _proc, addr, _send = prefill
    kv, aux = pool(fill=False)
    with pytest.raises(kvferry.InvalidArgument):
        kvferry.Node("sideways", LAYOUT, [(kv[0].ctypes.data, kv[0].nbytes)])
    with pytest.raises(kvferry.InvalidArgument):  # too few and too short regions
        kvferry.Node("decode", LAYOUT, [(kv[0].ctypes.data, 16)])
    with pytest.raises(kvferry.InvalidArgument):
        node("decode", kv, aux, transfer_retries="many")
    d = node("decode", kv, aux)
    peer = d.connect([addr])
    with pytest.raises(kvferry.InvalidArgument):  # a page index past the pool
        d.open_receiver(31, [peer], pages=[LAYOUT["pages"]], aux_slot=0)
    with pytest.raises(kvferry.InvalidArgument):  # a peer nobody connected
        d.open_receiver(32, [peer + 99], pages=[1], aux_slot=0)
    d.open_receiver(33, [peer], pages=[1], aux_slot=0)
    with pytest.raises(kvferry.InvalidArgument):  # the room id is in use
        d.open_receiver(33, [peer], pages=[2], aux_slot=0)
    with pytest.raises(kvferry.InvalidArgument):
        d.poll(999)
    d.shutdown()
    with pytest.raises(kvferry.NodeClosed):
        d.connect([addr])
    with pytest.raises(kvferry.ConnectError):
        other = node("decode", kv, aux)
        other.connect(["127.0.0.1:1"])


def test_metrics_are_served_in_prometheus_format_with_the_clis_names(prefill):
    import socket
    import urllib.request

    _proc, addr, _send = prefill
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_addr = "127.0.0.1:%d" % s.getsockname()[1]
    kvferry.enable_metrics(metrics_addr)
    with pytest.raises(kvferry.InvalidArgument, match="already enabled"):
        kvferry.enable_metrics()
    kv, aux = pool(fill=False)
    d = node("decode", kv, aux)
    d.open_receiver(90, [d.connect([addr])], pages=[1, 2, 3], aux_slot=0)
    assert d.wait(90, 20.0) == KVPoll.Success
    want = 'kvferry_rooms_succeeded_total{role="decode"} 1'
    deadline = time.monotonic() + 10
    while True:
        served = urllib.request.urlopen("http://%s/metrics" % metrics_addr, timeout=5).read().decode()
        if want in served or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert want in served, served
    assert "kvferry_rooms_live" in kvferry.metrics_text()
    d.shutdown()


def test_a_listener_that_never_answers_the_handshake_raises_handshake_timeout():
    import socket

    kv, aux = pool(fill=False)
    d = node("decode", kv, aux, handshake_timeout_ms=300)
    # The kernel completes the TCP connection into the backlog; nobody ever answers.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    started = time.time()
    with pytest.raises(kvferry.HandshakeTimeout):
        d.connect([f"127.0.0.1:{silent.getsockname()[1]}"])
    assert time.time() - started < 5
    silent.close()
    d.shutdown()


def test_a_room_asked_for_another_prompt_fails_prompt_mismatch_and_writes_nothing(prefill):
    _proc, addr, _send = prefill
    kv, aux = pool(fill=False)
    d = node("decode", kv, aux)
    peer = d.connect([addr])
    d.open_receiver(11, [peer], pages=[5, 6, 7], aux_slot=0,
                    prompt=kvferry.prompt_digest(prompt_tokens(11)))
    d.open_receiver(12, [peer], pages=[8, 9, 10], aux_slot=1,
                    prompt=kvferry.prompt_digest(prompt_tokens(11)))
    assert d.wait(11, 20.0) == KVPoll.Success
    assert d.wait(12, 20.0) == KVPoll.Failed
    err = d.failure(12)
    assert isinstance(err, kvferry.ProtocolFailure) and err.args[0] == "prompt_mismatch", err
    assert not kv[:, 8:11, :].any() and not aux[1].any()
    d.shutdown()


def test_a_chunk_for_a_room_the_decode_refused_raises_its_failure():
    """A decode asked for room 13 with other tokens before the prefill opened it: the open
    succeeds, and the first chunk raises the room's failure, not a bare unknown-room error."""
    kv, aux = pool(fill=True)
    p = node("prefill", kv, aux)
    addr = p.listen("127.0.0.1:0")[0]
    dkv, daux = pool(fill=False)
    d = node("decode", dkv, daux)
    d.open_receiver(13, [d.connect([addr])], pages=[1], aux_slot=0,
                    prompt=kvferry.prompt_digest([9, 9]))
    assert p.next_announcement(timeout=10.0)[0] == 13
    p.open_sender(13, 0, prompt=kvferry.prompt_digest(prompt_tokens(13)))
    with pytest.raises(kvferry.ProtocolFailure) as err:
        p.send_chunk(13, [1], last=True, aux_slot=0)
    assert err.value.args[0] == "prompt_mismatch"
    assert d.wait(13, 10.0) == KVPoll.Failed
    d.shutdown()
    p.shutdown()


def test_an_announcement_says_what_the_decode_wants_from_this_rank():
    """A room fed by two prefills, one of them an idle source: the one asked for pages hears
    how many after how many skipped, the idle one hears that nothing is wanted (None); each
    opens and sends its chunk, and the room lands the first one's pages only."""
    kv, aux = pool(fill=True)
    p, q = node("prefill", kv, aux), node("prefill", kv, aux)
    addrs = [n.listen("127.0.0.1:0")[0] for n in (p, q)]
    dkv, daux = pool(fill=False)
    d = node("decode", dkv, daux)
    d.open_receiver(21, [d.connect([a]) for a in addrs], pages=[4, 5], aux_slot=1, skip_pages=1,
                    idle_sources=[1])
    heard = {}
    for name, n in (("asked", p), ("idle", q)):
        room, generation, pages, skip = n.next_announcement(timeout=10.0)
        heard[name] = (room, pages, skip)
        n.open_sender(room, generation)
        n.send_chunk(room, [1, 2, 3], last=True, aux_slot=2)
    assert heard == {"asked": (21, 2, 1), "idle": (21, 0, None)}
    assert d.wait(21, 10.0) == KVPoll.Success
    for r in range(REGIONS):
        assert (dkv[r, 4] == kv[r, 2]).all() and (dkv[r, 5] == kv[r, 3]).all()
    d.shutdown()
    p.shutdown()
    q.shutdown()


def test_the_prompt_digest_is_the_documented_one_and_refuses_ids_outside_u32():
    assert kvferry.prompt_digest([]) == 0x2D06800538D394C2
    assert kvferry.prompt_digest([1, 2, 3]) == 0x6BBF7429332BEA48
    assert kvferry.prompt_digest(range(1000)) == 0x836BCD8C25B77AFD
    for bad in ([-1], [2**32]):
        with pytest.raises(kvferry.InvalidArgument):
            kvferry.prompt_digest(bad)


def test_a_room_the_embedder_fails_ends_with_that_reason_once(prefill):
    """A room a decode cannot use (its parameters did not fit) is opened and failed with the
    reason: its failure is that reason (the core counts it there, as every failure)."""
    _proc, addr, _send = prefill
    kv, aux = pool(fill=False)
    d = node("decode", kv, aux)
    peer = d.connect([addr])
    d.open_receiver(92, [peer])
    assert d.fail(92, "incompatible_peer")
    assert not d.fail(92, "incompatible_peer"), "a room fails once"
    err = d.failure(92)
    assert isinstance(err, kvferry.ProtocolFailure) and err.args[0] == "incompatible_peer", err
    with pytest.raises(kvferry.InvalidArgument, match="no failure reason"):
        d.fail(92, "bad_luck")
    d.shutdown()


def test_a_failure_is_published_in_the_metrics_even_when_the_node_goes_quiet(prefill):
    """The node's last change reaches its metrics within their export interval (0.5 s) even
    when nothing happens after it (its session to the prefill closed, no timer left)."""
    import re

    _proc, addr, _send = prefill
    try:
        kvferry.enable_metrics()
    except kvferry.InvalidArgument:
        pass  # another test of this process enabled them
    kv, aux = pool(fill=False)
    d = node("decode", kv, aux)
    d.open_receiver(93, [d.connect([addr])])
    assert d.fail(93, "incompatible_peer")
    counted = re.compile(r'kvferry_rooms_failed_total\{(?=[^}]*reason="incompatible_peer")(?=[^}]*role="decode")[^}]*\} [1-9]')
    deadline = time.monotonic() + 3
    while not counted.search(kvferry.metrics_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counted.search(kvferry.metrics_text()), kvferry.metrics_text()
    d.shutdown()
