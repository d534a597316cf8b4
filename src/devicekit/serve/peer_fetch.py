"""Reading one peer's ``/api/status``: a bounded HTTP GET with one hard deadline.

A peer is another machine's ``devicekit serve``; what it sends is other users' text and may be
hostile. :func:`fetch_body` never takes longer than its timeout once connected (the request and
every read count against one deadline, so a peer that sends a byte a second cannot hold it),
reads at most :data:`MAX_BYTES` of body (the hard ceiling before anything decodes it), and
accepts only a ``200`` answer without chunked encoding. It returns bytes: the body becomes
objects in one place only, :func:`devicekit.serve.peer_document.decode_status` (msgspec, linear
in the bytes). Every failure is a :class:`PeerError` whose text is one line, already inert.
Name lookup is the caller's to bound (:mod:`~devicekit.serve.lab` reads each peer in a daemon
thread it stops waiting for).

Usage::

    from devicekit.serve.peer_fetch import PeerAddress, PeerError, fetch_body

    peer = PeerAddress.parse("gpu3:9400")          # also http://gpu3:9400/ or [fd00::3]:9400
    try:
        body = fetch_body(peer, "/api/status", timeout=3.0)
    except PeerError as exc:
        print(peer.label, exc)                      # gpu3:9400 connection refused (...)
"""

from __future__ import annotations

import http.client
import io
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from devicekit.errors import InvalidValueError
from devicekit.serve.hosts import host_name
from devicekit.serve.inert import inert_text

__all__ = ["PeerAddress", "PeerError", "fetch_body", "MAX_BYTES", "DEFAULT_PORT"]

#: the port ``devicekit serve`` listens on unless told otherwise
DEFAULT_PORT = 9400
#: the largest body read from a peer, the ceiling before decoding (a real /api/status of 8 busy
#: GPUs is ~30 KiB; decoding the worst 4 MiB takes milliseconds: docs/lab.md)
MAX_BYTES = 4 * 1024 * 1024
#: the largest response head read
MAX_HEAD = 32 * 1024


class PeerError(Exception):
    """A peer that did not give a usable answer; ``str()`` is one inert line saying why."""


@dataclass(frozen=True)
class PeerAddress:
    """Where a peer listens: ``host`` (a name or a bare IP), ``port``, and ``label``, how the
    user wrote it (``host:port``)."""

    host: str
    port: int
    label: str

    @property
    def netloc(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def url(self, path: str = "/") -> str:
        return f"http://{self.netloc}{path}"

    @classmethod
    def parse(cls, text: str) -> PeerAddress:
        """``HOST``, ``HOST:PORT``, ``[V6]:PORT`` or ``http://HOST:PORT/``; a one-line
        :class:`InvalidValueError` naming the value otherwise. The port defaults to 9400."""
        raw = text.strip()
        if "://" in raw:
            try:
                parts = urlsplit(raw)
                parts.port  # noqa: B018  (a bad port raises here)
            except ValueError:
                raise _bad(text, "is not a URL") from None
            if parts.scheme != "http":
                raise _bad(text, "must be http:// (devicekit serve speaks plain HTTP; put TLS in "
                                 "front of it and give its address)")
            if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
                raise _bad(text, "must be only http://HOST:PORT/ (no path, user or query)")
            raw = parts.netloc
        name = host_name(raw) if raw and "/" not in raw else None
        if name is None:
            raise _bad(text, "is not HOST:PORT")
        if raw.startswith("["):
            port_text = raw.rsplit("]", 1)[1][1:]
        elif raw.count(":") == 1:
            port_text = raw.partition(":")[2]
        else:
            port_text = ""
        port = int(port_text) if port_text else DEFAULT_PORT
        if not 1 <= port <= 65535:
            raise _bad(text, "has a port outside 1-65535")
        label = f"[{name}]" if ":" in name else name
        return cls(name, port, label if port == DEFAULT_PORT else f"{label}:{port}")


def _bad(text: str, why: str) -> InvalidValueError:
    return InvalidValueError(f"host '{inert_text(text, 100)}' {why}; write e.g. gpu3:9400")


def fetch_body(peer: PeerAddress, path: str, *, timeout: float, limit: int = MAX_BYTES) -> bytes:
    """GET ``path`` from ``peer``: the body of its ``200`` answer (see the module doc)."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((peer.host, peer.port), timeout=timeout)
    except TimeoutError:
        raise PeerError(f"no answer within {timeout:g} s (connecting)") from None
    except OSError as exc:
        raise PeerError(_reason(exc)) from None
    try:
        request = (f"GET {path} HTTP/1.1\r\nHost: {peer.netloc}\r\nAccept: application/json\r\n"
                   "User-Agent: devicekit-lab\r\nConnection: close\r\n\r\n")
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(request.encode("ascii", "replace"))
        status, body = _read_answer(sock, deadline, timeout, limit)
    except TimeoutError:
        raise PeerError(f"no answer within {timeout:g} s") from None
    except OSError as exc:
        raise PeerError(_reason(exc)) from None
    finally:
        sock.close()
    if status != 200:
        first = body[:200].decode("utf-8", "replace").strip().splitlines()
        said = f": {inert_text(first[0], 160)}" if first else ""
        raise PeerError(f"answered HTTP {status}{said}")
    return body


def _read_answer(sock: socket.socket, deadline: float, timeout: float,
                 limit: int) -> tuple[int, bytes]:
    """(status, body) of one answer, read until the peer closes or the body is complete."""
    buffer = bytearray()
    head_end = -1
    length: int | None = None
    status = 0
    while True:
        if head_end >= 0 and length is not None and len(buffer) - head_end >= length:
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PeerError(f"no complete answer within {timeout:g} s")
        sock.settimeout(remaining)
        chunk = sock.recv(64 * 1024)
        if not chunk:
            break
        buffer += chunk
        if head_end < 0:
            found = buffer.find(b"\r\n\r\n")
            if found < 0:
                if len(buffer) > MAX_HEAD:
                    raise PeerError("answer head larger than 32 KiB: not devicekit serve")
                continue
            head_end = found + 4
            status, length = _head(bytes(buffer[:head_end]), limit)
        if len(buffer) - head_end > limit:
            raise PeerError(f"answer larger than {limit // (1024 * 1024)} MiB: refused")
    if head_end < 0:
        raise PeerError("closed the connection without an answer" if not buffer
                        else "sent no complete HTTP answer")
    body = bytes(buffer[head_end:])
    if length is not None:
        if len(body) < length:
            raise PeerError(f"answer cut short ({len(body)} of {length} bytes)")
        body = body[:length]
    return status, body


def _head(head: bytes, limit: int) -> tuple[int, int | None]:
    line, _, rest = head.partition(b"\r\n")
    words = line.decode("latin-1").split(None, 2)
    if len(words) < 2 or not words[0].startswith("HTTP/1.") or not words[1].isdigit():
        raise PeerError(f"did not answer in HTTP ('{inert_text(line[:60].decode('latin-1'), 60)}')")
    try:
        headers = http.client.parse_headers(io.BytesIO(rest))
    except http.client.HTTPException:
        raise PeerError("sent too many or too long headers: not devicekit serve") from None
    if "Transfer-Encoding" in headers:
        raise PeerError("sent a chunked answer: not devicekit serve")
    raw = headers.get("Content-Length")
    length = None
    if raw is not None:
        if not raw.strip().isdigit():
            raise PeerError("sent a bad Content-Length")
        length = int(raw.strip())
        if length > limit:
            raise PeerError(f"answer of {length} bytes, more than {limit // (1024 * 1024)} MiB: "
                            "refused")
    return int(words[1]), length


def _reason(exc: OSError) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is devicekit serve running there, on that port?)"
    if isinstance(exc, socket.gaierror):
        return f"unknown host ({inert_text(exc.strerror or exc, 80)})"
    if isinstance(exc, ConnectionResetError):
        return "connection reset by the peer"
    return f"cannot connect ({inert_text(exc.strerror or exc, 80)})"
