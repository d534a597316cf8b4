"""A hostile lab peer on loopback: a raw HTTP server that answers each connection its own way.

Usage (``raw_peer`` is a fixture; import it into the test module)::

    from tests.serve.raw_peer import answer, drip, raw_peer_fixture  # the fixture raw_peer

    def test_x(raw_peer):
        peer = raw_peer(answer(b'{"schema": 1, "gpus": []}'))
        peer.address            # "127.0.0.1:PORT", for --hosts / --peer
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

__all__ = ["RawPeer", "Respond", "answer", "drip", "raw_peer_fixture", "stream_forever"]

Respond = Callable[[socket.socket], None]


class RawPeer:
    """Answers every connection on a loopback port with ``respond(conn)``, in one thread."""

    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.settimeout(0.1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.listener.getsockname()[1]}"

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    head = b""
                    while b"\r\n\r\n" not in head and len(head) < 65536:
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        head += chunk
                    self.respond(conn)
                except OSError:  # the client gave up (as it should): nothing to do
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.listener.close()


@pytest.fixture(name="raw_peer")
def raw_peer_fixture() -> Iterator[Callable[[Respond], RawPeer]]:
    """``raw_peer(respond)``: a started :class:`RawPeer`; all closed after the test."""
    peers: list[RawPeer] = []

    def make(respond: Respond) -> RawPeer:
        peers.append(RawPeer(respond))
        return peers[-1]

    yield make
    for peer in peers:
        peer.close()


def answer(body: bytes, status: str = "200 OK", headers: str = "") -> Respond:
    def respond(conn: socket.socket) -> None:
        length = "" if "Content-Length" in headers or "Transfer" in headers else \
            f"Content-Length: {len(body)}\r\n"
        conn.sendall(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{length}"
                     f"{headers}Connection: close\r\n\r\n".encode() + body)
    return respond


def stream_forever(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
    chunk = b"[" + b"0," * 32768
    for _ in range(200):  # 13 MiB at most, if nobody stops reading
        conn.sendall(chunk)


def drip(conn: socket.socket) -> None:
    for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789":
        conn.sendall(bytes([byte]))
        time.sleep(0.3)
