"""Python nodes over RDMA: the wheel carries verbs without requiring them. Where there is no
RDMA device, ``transport="rdma"`` refuses to start naming what is missing and ``"auto"``
moves over TCP; where there is one (the soft-RoCE guest sets ``KVFERRY_TEST_RDMA=1``, and
then nothing here may skip), rooms move over RDMA with every byte checked, a TCP-only peer
is served over TCP, and a prefill killed mid-room fails the room with a peer reason."""

import multiprocessing as mp
import os
import signal
import subprocess
import time

import numpy as np
import pytest

import kvferry
from kvferry import KVPoll
from test_node import expected_pages, node, pool

RDMA_HERE = os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))
REQUIRED = os.environ.get("KVFERRY_TEST_RDMA") == "1"
needs_rdma = pytest.mark.skipif(not (RDMA_HERE or REQUIRED), reason="no RDMA device on this host")
no_rdma = pytest.mark.skipif(RDMA_HERE or REQUIRED, reason="this host has an RDMA device")


def serve(addr_queue, stop, transport, mode):
    """A prefill on ``transport`` that sends source pages 1, 2, 3 of every room asked for
    (``mode`` "partial": only page 1, the room left open, then it waits to be killed)."""
    kv, aux = pool(fill=True)
    n = node("prefill", kv, aux, transport=transport)
    addr_queue.put(n.listen("127.0.0.1:0")[0])
    while not stop.is_set():
        a = n.next_announcement(timeout=0.1)
        if a is None:
            continue
        n.open_sender(a[0], a[1])
        if mode == "partial":
            n.send_chunk(a[0], [1], last=False)
            # Its session has chosen its path once the peers' hellos crossed.
            deadline = time.time() + 10
            while not n.session_paths() and time.time() < deadline:
                time.sleep(0.01)
        else:
            n.send_chunk(a[0], [1, 2, 3], last=True, aux_slot=2)
            n.wait(a[0], 30.0)
        addr_queue.put(("sent", n.session_paths()))
    n.shutdown()


class Prefill:
    def __init__(self, transport, mode="full"):
        ctx = mp.get_context("spawn")
        self.queue, self.stop = ctx.Queue(), ctx.Event()
        self.proc = ctx.Process(target=serve, args=(self.queue, self.stop, transport, mode))
        self.proc.start()
        self.addr = self.queue.get(timeout=60)

    def paths(self):
        kind, paths = self.queue.get(timeout=30)
        assert kind == "sent"
        return paths

    def close(self):
        self.stop.set()
        self.proc.join(timeout=20)
        if self.proc.is_alive():
            self.proc.kill()


def move_rooms(d, peer, rooms, kv, aux):
    want_kv, want_aux = expected_pages()
    for room in rooms:
        kv[:, 5:8, :] = 0
        d.open_receiver(room, [peer], pages=[5, 6, 7], aux_slot=0)
        assert d.wait(room, 30.0) == KVPoll.Success, d.failure(room)
        assert np.array_equal(kv[:, 5:8, :], want_kv), f"room {room}"
        assert np.array_equal(aux[0], want_aux)
        d.forget(room)


def test_the_wheel_does_not_link_libibverbs():
    so = kvferry._kvferry.__file__
    needed = subprocess.run(["readelf", "-d", so], capture_output=True, text=True, check=True).stdout
    assert "NEEDED" in needed, needed
    assert "libibverbs" not in needed and "librdmacm" not in needed, needed


WITHOUT_RDMA_CORE = """
import numpy as np, kvferry
layout = dict(layers=1, planes=1, page_bytes=4096, pages=4, aux_bytes=64, slots=2)
def node(role, **kw):
    kv = np.zeros((4, 4096), dtype=np.uint8); aux = np.zeros((2, 64), dtype=np.uint8)
    n = kvferry.Node(role, layout, [(kv.ctypes.data, kv.nbytes)], aux=(aux.ctypes.data, aux.nbytes), token=b"t", **kw)
    return n, kv, aux
try:
    node("decode", transport="rdma")
    raise SystemExit("transport=rdma started without libibverbs")
except kvferry.TransportUnavailable as e:
    assert "libibverbs" in str(e), e
p, pkv, _ = node("prefill", transport="tcp")
pkv[:] = 7
d, dkv, _ = node("decode")
peer = d.connect(p.listen("127.0.0.1:0"))
d.open_receiver(1, [peer], pages=[2], aux_slot=0)
a = p.next_announcement(timeout=10.0)
p.open_sender(a[0], a[1]); p.send_chunk(1, [0], last=True, aux_slot=0)
assert d.wait(1, 10.0) == kvferry.KVPoll.Success and (dkv[2] == 7).all()
assert {path for _, path in d.session_paths()} == {"tcp"}
print("tcp without rdma-core: ok")
"""


def libibverbs_path():
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return next((line.split("=>")[1].strip() for line in out.splitlines() if "libibverbs.so.1 " in line), None)


@pytest.mark.skipif(os.geteuid() != 0 or libibverbs_path() is None,
                    reason="hiding libibverbs needs root and an installed libibverbs")
def test_without_rdma_core_the_wheel_imports_moves_rooms_over_tcp_and_rdma_names_libibverbs():
    """libibverbs hidden in a mount namespace (an empty file bound over it), as on a host
    without rdma-core."""
    import sys

    script = (f"mount --bind /dev/null {libibverbs_path()} && "
              f"exec {sys.executable} -c '{WITHOUT_RDMA_CORE}'")
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "tcp without rdma-core: ok" in r.stdout, r.stdout + r.stderr


@no_rdma
def test_rdma_refuses_to_start_without_a_device_naming_what_is_missing():
    kv, aux = pool(fill=False)
    with pytest.raises(kvferry.TransportUnavailable, match="RDMA|libibverbs|rdma-core"):
        node("decode", kv, aux, transport="rdma")


def test_auto_with_a_peer_process_on_this_host_moves_over_the_same_host_path():
    p = Prefill("auto")
    try:
        kv, aux = pool(fill=False)
        d = node("decode", kv, aux)  # transport defaults to auto
        peer = d.connect([p.addr])
        move_rooms(d, peer, range(1, 11), kv, aux)
        assert {path for _, path in d.session_paths()} == {"cma"}, d.session_paths()
        assert {path for _, path in p.paths()} == {"cma"}
        d.shutdown()
    finally:
        p.close()


@no_rdma
def test_auto_moves_over_tcp_where_the_peer_turns_the_same_host_path_off_and_there_is_no_rdma():
    p = Prefill("tcp")
    try:
        kv, aux = pool(fill=False)
        d = node("decode", kv, aux)
        peer = d.connect([p.addr])
        move_rooms(d, peer, [1, 2], kv, aux)
        assert {path for _, path in d.session_paths()} == {"tcp"}
        assert {path for _, path in p.paths()} == {"tcp"}
        d.shutdown()
    finally:
        p.close()


def test_same_host_on_both_sides_moves_over_the_same_host_path():
    p = Prefill("same-host")
    try:
        kv, aux = pool(fill=False)
        d = node("decode", kv, aux, transport="same-host")
        peer = d.connect([p.addr])
        move_rooms(d, peer, range(1, 6), kv, aux)
        assert {path for _, path in d.session_paths()} == {"cma"}, d.session_paths()
        assert {path for _, path in p.paths()} == {"cma"}
        d.shutdown()
    finally:
        p.close()


def test_same_host_refuses_a_peer_that_turns_the_path_off_and_its_rooms_fail_incompatible_peer():
    p = Prefill("tcp")
    try:
        kv, aux = pool(fill=False)
        d = node("decode", kv, aux, transport="same-host")
        try:
            peer = d.connect([p.addr])
        except kvferry.TransportUnavailable as e:
            # This node refused the session before the connect returned, and says why.
            assert "requires the same-host path" in str(e), e
            return
        d.open_receiver(1, [peer], pages=[5, 6, 7], aux_slot=0)
        assert d.wait(1, 30.0) == KVPoll.Failed
        failure = d.failure(1)
        assert "incompatible_peer" in str(failure.args), failure.args
        assert (kv[:, 5:8, :] == 0).all(), "nothing moved over TCP"
        d.shutdown()
    finally:
        p.close()


def test_an_unknown_transport_is_refused_naming_the_choices():
    kv, aux = pool(fill=False)
    with pytest.raises(kvferry.InvalidArgument, match='"auto".*"rdma".*"tcp"'):
        node("decode", kv, aux, transport="infiniband")


@needs_rdma
@pytest.mark.parametrize("transport", ["rdma", "auto"])
def test_rooms_move_over_rdma_with_every_byte_checked(transport):
    # A prefill on "rdma" takes no same-host path, so an "auto" decode picks RDMA.
    p = Prefill("rdma")
    try:
        kv, aux = pool(fill=False)
        d = node("decode", kv, aux, transport=transport)
        peer = d.connect([p.addr])
        move_rooms(d, peer, range(1, 21), kv, aux)
        assert {path for _, path in d.session_paths()} == {"rdma"}, d.session_paths()
        assert "rdma" in {path for _, path in p.paths()}
        page_bytes = kv.shape[0] * kv.shape[2]
        print(f"{transport}: 20 rooms over {d.session_paths()}, {20 * 3 * page_bytes} KV bytes "
              "and 20 aux rows, every byte checked")
        d.shutdown()
    finally:
        p.close()


@needs_rdma
def test_an_rdma_node_and_a_tcp_only_node_move_rooms_over_tcp_and_say_so():
    for prefill_transport, decode_transport in [("tcp", "rdma"), ("rdma", "tcp")]:
        p = Prefill(prefill_transport)
        try:
            kv, aux = pool(fill=False)
            d = node("decode", kv, aux, transport=decode_transport)
            peer = d.connect([p.addr])
            move_rooms(d, peer, [1, 2, 3], kv, aux)
            assert {path for _, path in d.session_paths()} == {"tcp"}, d.session_paths()
            assert {path for _, path in p.paths()} == {"tcp"}
            d.shutdown()
        finally:
            p.close()


@needs_rdma
def test_a_prefill_killed_mid_room_over_rdma_fails_the_room_and_its_pages_come_back():
    p = Prefill("rdma", mode="partial")
    try:
        kv, aux = pool(fill=False)
        d = node("decode", kv, aux, transport="rdma", waiting_timeout_ms=5000)
        peer = d.connect([p.addr])
        d.open_receiver(31, [peer], pages=[5, 6, 7], aux_slot=0)
        assert "rdma" in {path for _, path in p.paths()}  # its first write went out
        os.kill(p.proc.pid, signal.SIGKILL)
        started = time.time()
        assert d.wait(31, 20.0) == KVPoll.Failed
        assert time.time() - started < 15
        failure = d.failure(31)
        assert isinstance(failure, kvferry.PeerFailure), failure
        deadline = time.time() + 20
        while not d.releasable(31):
            assert time.time() < deadline, "pages of a room whose prefill died never came back"
            time.sleep(0.05)
        d.shutdown()
    finally:
        p.close()
