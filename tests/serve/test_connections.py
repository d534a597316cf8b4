"""The serving thread over raw sockets: timeouts, keep-alive, pipelining, bad requests, the
connection caps and who is closed at a cap. Every server here is on 127.0.0.1, port 0; every
wait is bounded."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from devicekit.serve import StatusServer, connections
from devicekit.serve.connections import Limits, client_key, connection_cap
from tests.serve.conftest import machine


def serve(simulate, **limits: float) -> StatusServer:
    simulate(machine())
    server = StatusServer("127.0.0.1", 0, interval=0.2, limits=Limits(**limits))
    server.start()
    return server


@pytest.fixture
def make_server(simulate) -> Iterator:
    started: list[StatusServer] = []

    def make(**limits: float) -> StatusServer:
        server = serve(simulate, **limits)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


def connect(server: StatusServer, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(server.address, timeout=timeout)
    return sock


def read_response(sock: socket.socket, deadline: float = 5.0
                  ) -> tuple[int, dict[str, str], bytes, bytes]:
    """One response from ``sock``, read within ``deadline`` seconds: status, headers, body and
    the bytes read past it (the start of a pipelined next response)."""
    sock.settimeout(deadline)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    length = int(headers["Content-Length"])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed mid-body"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length], rest[length:]


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closes ``sock`` (EOF or reset), None if still open after
    ``seconds``; bytes the server sends meanwhile are read and dropped."""
    start = time.monotonic()
    sock.settimeout(0.05)
    while time.monotonic() - start < seconds:
        try:
            if not sock.recv(65536):
                return time.monotonic() - start
        except TimeoutError:
            continue
        except ConnectionError:
            return time.monotonic() - start
    return None


def test_a_silent_connection_is_closed_after_the_head_timeout(make_server):
    server = make_server(head_timeout=0.5)
    with connect(server) as silent, connect(server) as slow:
        slow.sendall(b"GET /metrics HTTP/1.1\r\n")  # slowloris: a line, then a byte at a time
        start = time.monotonic()
        for byte in b"Host: localhost":
            if time.monotonic() - start > 2:
                break
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.1)
        assert closed_within(silent, 5) is not None
        assert closed_within(slow, 5) is not None
        assert time.monotonic() - start < 5
    assert server.loop is not None and server.loop.counts["timed_out"] >= 2


def test_keep_alive_then_idle_timeout(make_server):
    server = make_server(keepalive_timeout=0.6)
    with connect(server) as sock:
        for path in ("/metrics", "/api/status", "/"):
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
            status, headers, body, _ = read_response(sock)
            assert status == 200 and body and "Connection" not in headers
        waited = closed_within(sock, 5)
        assert waited is not None and 0.3 < waited < 5


def test_pipelined_requests_are_answered_in_order(make_server):
    server = make_server()
    with connect(server) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n"
                     b"HEAD /api/status HTTP/1.1\r\nHost: localhost\r\n\r\n"
                     b"GET /nope HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        status, _, body, data = read_response(sock)
        assert status == 200 and b"devicekit_gpus" in body
        sock.settimeout(5)
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")  # HEAD: headers only, the full length
        assert head.startswith(b"HTTP/1.1 200 ") and b"Content-Length: 0\r\n" not in head
        assert rest.startswith(b"HTTP/1.1 404 ") and b"Connection: close" in rest


def test_http10_without_host_and_bad_requests(make_server):
    server = make_server()
    with connect(server) as sock:
        sock.sendall(b"GET /api/status HTTP/1.0\r\n\r\n")
        status, headers, body, _ = read_response(sock)
        assert status == 200 and headers["Connection"] == "close" and body.startswith(b"{")
        assert closed_within(sock, 5) is not None
    with connect(server) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        assert read_response(sock)[1]["Connection"] == "keep-alive"
    for raw, code in [(b"GET /\r\n\r\n", 400), (b"GET / HTTP/2.0\r\n\r\n", 505),
                      (b"GET / FTP/1.1\r\n\r\n", 400),
                      (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
                      (b"GET / HTTP/1.1\r\nX: " + b"a" * 40_000 + b"\r\n\r\n", 431),
                      (b"POST /api/status HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5"
                       b"\r\n\r\nhello", 405)]:
        with connect(server) as sock:
            sock.sendall(raw)
            status, headers, body, _ = read_response(sock)
            assert status == code and body.endswith(b"\n") and body.count(b"\n") == 1, raw[:30]
            assert headers["Connection"] == "close"  # nothing after it is read as a request
            assert headers["X-Content-Type-Options"] == "nosniff"
            assert closed_within(sock, 5) is not None


def test_an_answer_nobody_reads_is_dropped_after_the_write_timeout(make_server):
    server = make_server(write_timeout=0.5)
    with connect(server) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        request = b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"
        sock.sendall(request * 2000)  # ~20 MB of pages asked for, none read
        time.sleep(1.5)
        assert closed_within(sock, 10) is not None  # the rest was dropped, not sent forever


def test_idle_sockets_cost_no_thread_and_stop_closes_them(make_server):
    server = make_server()
    before = threading.active_count()
    socks = [connect(server) for _ in range(100)]
    try:
        with connect(server) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
            assert read_response(sock)[0] == 200
        assert threading.active_count() <= before + 1
        assert server.loop is not None
        deadline = time.monotonic() + 5
        while server.loop.open_connections < 100 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.loop.open_connections >= 100
        server.stop()
        assert all(closed_within(s, 5) is not None for s in socks[:5])
    finally:
        for s in socks:
            s.close()


def test_at_the_cap_the_oldest_idle_connection_goes(make_server):
    """At the cap a newcomer is always let in: the oldest connection that never sent a request
    makes room, before any keep-alive one that did."""
    server = make_server(connections=4, head_timeout=30, keepalive_timeout=30)
    assert server.loop is not None and server.loop.cap == 4
    idle, served = [], []
    try:
        for _ in range(4):
            idle.append(connect(server))
            time.sleep(0.05)  # accepted in this order
        for k in range(3):  # every newcomer is answered and stays (keep-alive)
            sock = connect(server)
            served.append(sock)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
            assert read_response(sock)[0] == 200
            assert closed_within(idle[k], 5) is not None  # the oldest silent one went
        assert closed_within(idle[3], 0.3) is None
        assert all(closed_within(s, 0.1) is None for s in served)
        for _ in range(2):  # the last silent one goes first, then the oldest keep-alive one
            newcomer = connect(server)
            served.append(newcomer)
            newcomer.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
            assert read_response(newcomer)[0] == 200
        assert closed_within(idle[3], 5) is not None and closed_within(served[0], 5) is not None
        assert all(closed_within(s, 0.1) is None for s in served[1:])
        assert server.loop.counts["evicted"] == 5 and server.loop.open_connections == 4
    finally:
        for s in idle + served:
            s.close()


def test_one_remote_address_evicts_only_its_own(make_server, monkeypatch):
    """Over loopback every client is one; pretend they come from 10.0.0.7 to see the per-address
    cap: that address keeps at most ``per_client`` connections, its oldest idle one goes first."""
    monkeypatch.setattr(connections, "client_key", lambda address: "10.0.0.7")
    server = make_server(per_client=3)
    idle = []
    try:
        for _ in range(5):
            idle.append(connect(server))
            time.sleep(0.05)
        assert closed_within(idle[0], 5) is not None and closed_within(idle[1], 5) is not None
        assert closed_within(idle[4], 0.3) is None
        assert server.loop is not None and server.loop.open_connections <= 3
    finally:
        for s in idle:
            s.close()


def test_a_flood_at_the_global_cap_evicts_the_flooder_not_a_light_client(make_server,
                                                                           monkeypatch):
    """The first connection comes from "10.0.0.9" (say, Prometheus, keep-alive), every later
    one from loopback, and all of them are idle keep-alive ones: past the global cap loopback
    makes room from its own connections, though the scraper's is the oldest."""
    keys = iter(["10.0.0.9"])
    monkeypatch.setattr(connections, "client_key", lambda address: next(keys, "loopback"))
    server = make_server(connections=6, head_timeout=30, keepalive_timeout=30)
    flood = []
    with connect(server) as scraper:
        scraper.sendall(b"GET /metrics HTTP/1.1\r\nHost: 10.0.0.1:9400\r\n\r\n")
        assert read_response(scraper)[0] == 200
        try:
            for _ in range(20):  # each asks once, then holds its connection (keep-alive)
                sock = connect(server)
                flood.append(sock)
                sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
                assert read_response(sock)[0] == 200
            assert closed_within(flood[-1], 0.3) is None
            assert closed_within(scraper, 0.2) is None  # never evicted for the flood
            scraper.sendall(b"GET /metrics HTTP/1.1\r\nHost: 10.0.0.1:9400\r\n\r\n")
            assert read_response(scraper)[0] == 200
            assert server.loop is not None and server.loop.counts["evicted"] >= 14
        finally:
            for s in flood:
                s.close()


def test_client_key_and_cap():
    assert client_key("127.0.0.1") == client_key("127.9.9.9") == client_key("::1") == "loopback"
    assert client_key("::ffff:127.0.0.1") == "loopback"
    assert client_key("::ffff:10.1.2.3") == client_key("10.1.2.3") == "10.1.2.3"
    assert client_key("2001:db8::1") == client_key("2001:db8::ffff") == "2001:db8::/64"
    assert client_key("2001:db8:0:1::1") != client_key("2001:db8::1")
    assert connection_cap(8) == 8 and 16 <= connection_cap(10**9) <= 10**9
