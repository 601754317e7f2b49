"""One plain TCP stream moving N bytes: `serve PORT N` receives N bytes at a time on each
connection and answers one byte after each N; `send HOST PORT N REPS` times each transfer on a
fresh connection (connect to answer, so each pays the handshake and slow start), and
`send-warm HOST PORT N REPS` times each transfer on one connection kept open (first byte to
answer, with the window the previous transfers opened), in ms."""
import socket, sys, time
if sys.argv[1] == "serve":
    port, n = int(sys.argv[2]), int(sys.argv[3])
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(4)
    buf = bytearray(1 << 20)
    while True:
        c, _ = s.accept()
        while True:
            got = 0
            while got < n:
                k = c.recv_into(buf, min(len(buf), n - got))
                if k == 0: break
                got += k
            if got < n: break
            c.sendall(b"k")
        c.close()
else:
    warm = sys.argv[1] == "send-warm"
    host, port, n, reps = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    data = b"\x5a" * (4 << 20)
    out = []
    c = None
    for _ in range(reps):
        t = time.perf_counter()
        if c is None:
            c = socket.create_connection((host, port))
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        left = n
        while left > 0:
            k = c.send(data[: min(left, len(data))])
            left -= k
        c.recv(1)
        out.append((time.perf_counter() - t) * 1000)
        if not warm:
            c.close(); c = None
    out.sort()
    print("plain_tcp_ms p50 %.0f min %.0f max %.0f" % (out[len(out) // 2], out[0], out[-1]))
