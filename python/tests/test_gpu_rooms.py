"""KV in GPU memory through the wheel (needs torch with CUDA and a GPU; skips otherwise): a
prefill process and a decode process, each with its KV pool in torch CUDA tensors, rooms
staged through the CUDA copy engine over loopback TCP (transport="tcp"), then the same rooms
on the same-host path the default transport takes (GPU to GPU over CUDA IPC), every byte
checked with torch on the device. The GPU check bundle runs it (scripts/gpu-check.sh)."""

import json
import multiprocessing as mp
import time

try:
    import torch
except ImportError:
    torch = None
if torch is None or not torch.cuda.is_available():
    if __name__ == "__main__":
        raise SystemExit("no CUDA device for torch here")
    import pytest

    pytest.skip("SKIPPED: no CUDA device for torch here", allow_module_level=True)

import kvferry  # noqa: E402
from kvferry import KVPoll  # noqa: E402

LAYOUT = dict(layers=8, planes=2, page_bytes=16384, pages=256)
REGIONS = LAYOUT["layers"] * LAYOUT["planes"]
TOKEN = b"gpu-token"
PAGES_PER_ROOM = 32
ROOMS = 32


def pool(fill):
    kv = torch.zeros((REGIONS, LAYOUT["pages"], LAYOUT["page_bytes"]), dtype=torch.uint8, device="cuda:0")
    if fill:
        ar = torch.arange(LAYOUT["page_bytes"], device="cuda:0")
        for r in range(REGIONS):
            for p in range(LAYOUT["pages"]):
                kv[r, p] = ((ar * (r + 3) + p * 7) % 251).to(torch.uint8)
    torch.cuda.synchronize()
    return kv


def node(role, kv, transport):
    spans, device = kvferry.tensor_spans([kv[r] for r in range(REGIONS)])
    assert device == 0
    return kvferry.Node(role, LAYOUT, spans, token=TOKEN, kv_device=device, transport=transport)


def serve_prefill(addr_queue, stop, transport):
    kv = pool(fill=True)
    n = node("prefill", kv, transport)
    addr_queue.put(n.listen("127.0.0.1:0")[0])
    while not stop.is_set():
        a = n.next_announcement(timeout=0.1)
        if a is None:
            continue
        room, generation, _pages, _skip = a
        n.open_sender(room, generation)
        first = (room % 4) * PAGES_PER_ROOM
        n.send_chunk(room, list(range(first, first + PAGES_PER_ROOM)), last=True)
    n.shutdown()


def rooms(transport):
    """The rooms between a prefill process and this one over `transport`: the decode's
    session path and GB/s."""
    ctx = mp.get_context("spawn")
    addr_queue, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=serve_prefill, args=(addr_queue, stop, transport))
    proc.start()
    try:
        addr = addr_queue.get(timeout=60)
        kv = pool(fill=False)
        want = pool(fill=True)
        d = node("decode", kv, transport)
        peer = d.connect([addr])
        started = time.time()
        for room in range(1, ROOMS + 1):
            dst = list(range((room % 8) * PAGES_PER_ROOM, (room % 8 + 1) * PAGES_PER_ROOM))
            d.open_receiver(room, [peer], pages=dst)
            assert d.wait(room, 60.0) == KVPoll.Success, d.failure(room)
            src = (room % 4) * PAGES_PER_ROOM
            torch.cuda.synchronize()
            assert torch.equal(kv[:, dst[0] : dst[-1] + 1], want[:, src : src + PAGES_PER_ROOM]), room
        seconds = time.time() - started
        gb = ROOMS * REGIONS * PAGES_PER_ROOM * LAYOUT["page_bytes"] / 1e9
        paths = {path for _, path in d.session_paths()}
        print(json.dumps(dict(check="python_gpu_rooms", transport=transport, paths=sorted(paths), rooms=ROOMS, gb=round(gb, 3), seconds=round(seconds, 3), gbps=round(gb / seconds, 3))))
        d.shutdown()
        return paths, gb / seconds
    finally:
        stop.set()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def test_rooms_move_between_gpu_processes_with_every_byte_checked_on_the_device():
    staged, staged_gbps = rooms("tcp")
    assert staged == {"tcp_staged"}, staged
    ipc, ipc_gbps = rooms("auto")
    assert ipc == {"cuda_ipc"}, ipc
    print(json.dumps(dict(check="python_ipc_rooms", gbps=round(ipc_gbps, 3), staged_gbps=round(staged_gbps, 3), ratio=round(ipc_gbps / staged_gbps, 3))))


if __name__ == "__main__":
    # The GPU machine may have no pytest: the check runs this file directly.
    test_rooms_move_between_gpu_processes_with_every_byte_checked_on_the_device()
    print("python GPU rooms: ok")
