"""One plain TCP stream moving N bytes: `serve PORT N` receives N bytes per connection and
answers one byte; `send HOST PORT N REPS` times each transfer (connect to answer), in ms."""
import socket, sys, time
if sys.argv[1] == "serve":
    port, n = int(sys.argv[2]), int(sys.argv[3])
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(4)
    buf = bytearray(1 << 20)
    while True:
        c, _ = s.accept()
        got = 0
        while got < n:
            k = c.recv_into(buf)
            if k == 0: break
            got += k
        c.sendall(b"k"); c.close()
else:
    host, port, n, reps = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    data = b"\x5a" * (4 << 20)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        c = socket.create_connection((host, port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        left = n
        while left > 0:
            k = c.send(data[: min(left, len(data))])
            left -= k
        c.recv(1); c.close()
        out.append((time.perf_counter() - t) * 1000)
    out.sort()
    print("plain_tcp_ms p50 %.0f min %.0f max %.0f" % (out[len(out) // 2], out[0], out[-1]))
