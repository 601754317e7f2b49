"""Prefills that leave are let go: a decode that names every prefill a router sends it to
(kvferry's ``KeptPeers``, as the SGLang backend and the vLLM connector do) while prefills
come and go holds no session, socket, peer id or memory for the ones gone or unused."""

import multiprocessing as mp
import os
import threading
import time

import numpy as np

import kvferry
from kvferry import KVPoll
from kvferry._peers import KeptPeers

LAYOUT = dict(layers=2, planes=2, page_bytes=4096, pages=16, aux_bytes=64, slots=4)
REGIONS = LAYOUT["layers"] * LAYOUT["planes"]
TOKEN = b"pytest-idle-peers"
IDLE_MS = 300
PREFILLS = 50


def node(role, **config):
    kv = np.zeros((REGIONS, LAYOUT["pages"], LAYOUT["page_bytes"]), dtype=np.uint8)
    aux = np.zeros((LAYOUT["slots"], LAYOUT["aux_bytes"]), dtype=np.uint8)
    spans = [(kv[r].ctypes.data, kv[r].nbytes) for r in range(REGIONS)]
    n = kvferry.Node(role, LAYOUT, spans, aux=(aux.ctypes.data, aux.nbytes), token=TOKEN, **config)
    return n, (kv, aux)


def prefill_farm(commands, answers):
    """Starts a prefill node per "start" (answering its address) and shuts the one named
    down per ("stop", address); each prefill sends pages 1-3 of every room asked for."""
    running = {}

    def serve(n, stop):
        while not stop.is_set():
            a = n.next_announcement(timeout=0.05)
            if a is not None:
                n.open_sender(a[0], a[1])
                n.send_chunk(a[0], [1, 2, 3], last=True, aux_slot=0)

    while True:
        cmd = commands.get()
        if cmd == "start":
            n, memory = node("prefill")
            addr = n.listen("127.0.0.1:0")[0]
            stop = threading.Event()
            t = threading.Thread(target=serve, args=(n, stop), daemon=True)
            t.start()
            running[addr] = (n, memory, stop, t)
            answers.put(addr)
        elif cmd == "quit":
            break
        else:
            n, _memory, stop, t = running.pop(cmd[1])
            stop.set()
            t.join()
            n.shutdown()
            answers.put("stopped")


def fds():
    return len(os.listdir("/proc/self/fd"))


def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_fifty_prefills_coming_and_going_leave_the_decode_flat():
    ctx = mp.get_context("spawn")
    commands, answers = ctx.Queue(), ctx.Queue()
    farm = ctx.Process(target=prefill_farm, args=(commands, answers), daemon=True)
    farm.start()
    d, _memory = node("decode", peer_idle_timeout_ms=IDLE_MS)
    peers = KeptPeers(d)

    def one_prefill(room, stays):
        commands.put("start")
        addr = answers.get(timeout=30)
        peer = peers.get([addr])
        d.open_receiver(room, [peer], pages=[4, 5, 6], aux_slot=1)
        assert d.wait(room, 10.0) == KVPoll.Success
        d.forget(room)
        if not stays:
            commands.put(("stop", addr))
            assert answers.get(timeout=30) == "stopped"
        return peer

    try:
        # Warm up (threads, allocator arenas), then measure.
        for room in range(5):
            one_prefill(room, stays=False)
        time.sleep(IDLE_MS * 3 / 1000)
        fds_before, rss_before = fds(), rss_kib()
        named = [one_prefill(100 + i, stays=i % 5 == 0) for i in range(PREFILLS)]
        deadline = time.monotonic() + 20 * IDLE_MS / 1000
        while d.counters()["peers_let_go"] < PREFILLS + 5:
            assert time.monotonic() < deadline, d.counters()
            time.sleep(0.05)
        assert not any(d.knows_peer(p) for p in named)
        assert fds() <= fds_before + 1, (fds(), fds_before)
        grown = rss_kib() - rss_before
        assert grown < 4096, f"the decode grew by {grown} KiB over {PREFILLS} prefills"
        # The next prefill named drops every name let go.
        one_prefill(1000, stays=False)
        assert len(peers) == 1
    finally:
        commands.put("quit")
        farm.join(timeout=30)
        d.shutdown()
