"""HTTP/1.x requests and responses of ``devicekit serve``, as bytes in and bytes out.

:func:`parse_request` reads one request's head (request line and headers, through the blank
line) with the standard library's header parser; :class:`Response` is what a route returns;
:func:`response_head` writes the status line and headers. Bodies are never read: a request that
carries one is answered and its connection closed. Every answer carries the security headers.

Usage::

    from devicekit.serve.http_messages import Response, parse_request, response_head

    request = parse_request(b"GET /metrics HTTP/1.1\\r\\nHost: localhost\\r\\n\\r\\n")
    request.path, request.keep_alive          # ('/metrics', True)
    head = response_head(Response(200, b"ok\\n"), keep_alive=True)
"""

from __future__ import annotations

import http.client
import io
import re
from dataclasses import dataclass, field
from email.message import Message
from email.utils import formatdate
from http import HTTPStatus

__all__ = ["Request", "Response", "BadRequest", "parse_request", "response_head", "head_end",
           "SECURITY_HEADERS", "MAX_HEAD_BYTES"]

#: the longest request head (request line and headers) read; past it, 431 and close
MAX_HEAD_BYTES = 32 * 1024
SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "style-src-attr 'unsafe-inline'; connect-src 'self'; "
                                "img-src 'self'; base-uri 'none'; form-action 'none'; "
                                "frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_END = re.compile(rb"\r?\n\r?\n")
_VERSION = re.compile(r"^HTTP/(\d+)\.(\d+)$")
_TEXT = "text/plain; charset=utf-8"


class BadRequest(Exception):
    """A request that cannot be answered as asked: its status and a one-line body."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(body)
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Request:
    """One parsed request head."""

    method: str
    target: str
    version: str
    headers: Message

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def has_body(self) -> bool:
        length = self.headers.get("Content-Length", "0").strip()
        return "Transfer-Encoding" in self.headers or length not in ("", "0")

    @property
    def keep_alive(self) -> bool:
        """Whether the client may send another request on this connection."""
        words = {w.strip().lower() for w in self.headers.get("Connection", "").split(",")}
        if "close" in words or self.has_body:
            return False
        return self.version == "HTTP/1.1" or "keep-alive" in words


@dataclass(frozen=True)
class Response:
    """What a route answers: status, body bytes, content type, extra headers."""

    status: int
    body: bytes
    content_type: str = _TEXT
    headers: dict[str, str] = field(default_factory=dict)


def head_end(buffer: bytes | bytearray, start: int = 0) -> int:
    """Where the request head in ``buffer`` ends (after its blank line), looking from ``start``;
    -1 while incomplete."""
    match = _END.search(buffer, start)
    return -1 if match is None else match.end()


def parse_request(head: bytes) -> Request:
    """The request whose head (through the blank line) is ``head``; :class:`BadRequest` if bad."""
    line, _, rest = head.partition(b"\n")
    words = line.decode("latin-1").strip().split()
    if len(words) != 3:
        raise BadRequest(400, "bad request line: send METHOD PATH HTTP/1.1\n")
    method, target, version = words
    match = _VERSION.match(version)
    if match is None:
        raise BadRequest(400, "bad request line: send METHOD PATH HTTP/1.1\n")
    if match.group(1) != "1":
        raise BadRequest(505, "only HTTP/1.0 and HTTP/1.1\n")
    try:
        headers = http.client.parse_headers(io.BytesIO(rest))
    except http.client.HTTPException:
        raise BadRequest(431, "request header fields too large or too many\n") from None
    if len(headers.get_all("Host") or ()) > 1:
        raise BadRequest(400, "more than one Host header\n")
    return Request(method, target, "HTTP/1.1" if match.group(2) != "0" else "HTTP/1.0", headers)


def response_head(response: Response, *, keep_alive: bool, http10: bool = False) -> bytes:
    """The status line and headers for ``response`` (Content-Length: the whole body's, also for
    HEAD); ``http10``: the client spoke HTTP/1.0, so keep-alive is said out loud."""
    try:
        phrase = HTTPStatus(response.status).phrase
    except ValueError:
        phrase = ""
    lines = [f"HTTP/1.1 {response.status} {phrase}",
             "Server: devicekit-serve",
             f"Date: {formatdate(usegmt=True)}",
             f"Content-Type: {response.content_type}",
             f"Content-Length: {len(response.body)}"]
    lines += [f"{name}: {value}" for name, value in {**SECURITY_HEADERS, **response.headers}.items()]
    if not keep_alive:
        lines.append("Connection: close")
    elif http10:
        lines.append("Connection: keep-alive")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
