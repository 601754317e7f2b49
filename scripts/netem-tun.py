"""A link between two TUN devices that delays, jitters and reorders packets the way
`tc qdisc ... netem delay D J reorder R%` does on both ends of a veth pair, for kernels
without sch_netem. Each packet, in each direction on its own: with probability R it leaves at
once, otherwise after D plus a uniform draw in [-J, J]; packets leave in the order of their
departure times, so jitter reorders too (as netem's time-ordered queue does).

    python3 scripts/netem-tun.py DEV_A DEV_B DELAY_MS JITTER_MS REORDER_PERCENT [SEED]

Creates both devices (IFF_TUN with a virtio-net header and TCP segmentation offload) in the caller's network namespace and
prints `ready` once they exist; the caller moves them into namespaces and gives them
addresses. Runs until killed. Needs CAP_NET_ADMIN and /dev/net/tun.
"""
import fcntl
import heapq
import os
import random
import selectors
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUNSETOFFLOAD = 0x400454D0
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04


def open_tun(name):
    # With a virtio-net header and TSO on, the kernel hands over TCP's segmentation-offload
    # packets (up to 64 KiB) whole, and takes them back whole on the other device: each
    # delayed or reordered unit is one GSO packet, as it is for netem on a veth, while TCP
    # still counts its window in MTU-sized segments.
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    flags = IFF_TUN | IFF_NO_PI | IFF_VNET_HDR
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), flags))
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    return fd


def main():
    dev_a, dev_b = sys.argv[1], sys.argv[2]
    delay, jitter = float(sys.argv[3]) / 1000, float(sys.argv[4]) / 1000
    reorder = float(sys.argv[5]) / 100
    rng = random.Random(int(sys.argv[6]) if len(sys.argv) > 6 else 1)
    a, b = open_tun(dev_a), open_tun(dev_b)
    peer = {a: b, b: a}
    sel = selectors.DefaultSelector()
    sel.register(a, selectors.EVENT_READ)
    sel.register(b, selectors.EVENT_READ)
    queue = []  # (departure, sequence, fd to write, packet)
    seq = 0
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, out, packet = heapq.heappop(queue)
            try:
                os.write(out, packet)
            except OSError:
                pass  # the device is down or full: the packet is lost, as on a wire
        timeout = max(0.0, queue[0][0] - now) if queue else None
        for key, _ in sel.select(timeout):
            fd = key.fd
            for _ in range(64):
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                wait = 0.0 if rng.random() < reorder else max(0.0, delay + rng.uniform(-jitter, jitter))
                seq += 1
                heapq.heappush(queue, (time.monotonic() + wait, seq, peer[fd], packet))


if __name__ == "__main__":
    main()
