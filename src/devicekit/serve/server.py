"""The HTTP server of ``devicekit serve``: stdlib ``ThreadingHTTPServer``, read-only, cached.

Routes (GET and HEAD only; anything else is 405, an unknown path 404):

- ``/``: the status page; ``/fragment``: its live part; ``/static/page.css``, ``/static/page.js``
- ``/metrics``: Prometheus text format
- ``/api/status``: the ``devicekit status --json`` document

Every response is bytes the :class:`~devicekit.serve.sampler.Sampler` built at its last sample,
so a request never waits for NVML and many clients are served at once (a thread each, at most
:data:`MAX_CLIENTS` at a time; past that a client gets 503 at once). Idle or slow connections
are closed after :data:`CLIENT_TIMEOUT` seconds. Nothing a request says is executed or stored.

Usage::

    from devicekit.serve.server import StatusServer

    server = StatusServer("127.0.0.1", 0, interval=2.0)   # port 0: any free port
    server.start()                                        # sampler + serving thread
    print(server.url)                                     # http://127.0.0.1:40123/
    server.stop()
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from devicekit.errors import ServeError
from devicekit.serve.prometheus import CONTENT_TYPE as METRICS_TYPE
from devicekit.serve.sampler import Sampler

__all__ = ["StatusServer", "MAX_CLIENTS", "CLIENT_TIMEOUT", "is_loopback", "resolve_host"]

MAX_CLIENTS = 256
CLIENT_TIMEOUT = 15.0
_SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "style-src-attr 'unsafe-inline'; connect-src 'self'; "
                                "img-src 'self'; base-uri 'none'; form-action 'none'; "
                                "frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_STATIC = {"/static/page.css": ("page.css", "text/css; charset=utf-8"),
           "/static/page.js": ("page.js", "text/javascript; charset=utf-8")}


def _static_files() -> dict[str, tuple[bytes, str]]:
    folder = resources.files("devicekit.serve") / "static"
    return {route: ((folder / name).read_bytes(), kind) for route, (name, kind) in _STATIC.items()}


def resolve_host(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The address family and numeric address to bind ``host`` to; :class:`ServeError` if none."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        raise ServeError(f"--host {host!r} is not an address or a name this machine can resolve "
                         f"({getattr(exc, 'strerror', None) or exc}); use e.g. --host 127.0.0.1") from None
    family, _, _, _, address = infos[0]
    return family, str(address[0])


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8 and ::1: only this machine can connect."""
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"
    timeout = CLIENT_TIMEOUT
    server_version = "devicekit-serve"
    sys_version = ""

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._answer(send_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(send_body=False)

    def _refuse(self) -> None:
        self._send(405, b"read-only: only GET and HEAD\n", "text/plain; charset=utf-8",
                   True, {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse  # noqa: N815

    def _answer(self, send_body: bool) -> None:
        owner = self.server.owner
        path = self.path.split("?", 1)[0]
        snap = owner.sampler.snapshot
        if path == "/metrics":
            self._send(200, snap.metrics_text, METRICS_TYPE, send_body)
        elif path == "/api/status":
            self._send(200, snap.status_json, "application/json", send_body)
        elif path == "/fragment":
            self._send(200, snap.fragment_html, "text/html; charset=utf-8", send_body)
        elif path in ("/", "/index.html"):
            self._send(200, owner.page(), "text/html; charset=utf-8", send_body)
        elif path in owner.static:
            body, kind = owner.static[path]
            self._send(200, body, kind, send_body)
        else:
            self._send(404, b"not found: try /, /metrics or /api/status\n",
                       "text/plain; charset=utf-8", send_body)

    def _send(self, code: int, body: bytes, kind: str, send_body: bool,
              extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in {**_SECURITY_HEADERS, **(extra or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        """Quiet: a status page polled every 2 s would fill the terminal."""


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True  # a restart right after a stop gets the port back

    def __init__(self, owner: StatusServer, address: tuple[str, int],
                 family: socket.AddressFamily) -> None:
        self.address_family = family
        self.owner = owner
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:  # too many at once: a quick 503 instead of one more thread
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                                b"Connection: close\r\nRetry-After: 1\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up mid-answer is normal; never print a traceback for it."""


class StatusServer:
    """The sampler and the HTTP server together; :meth:`start` binds, :meth:`stop` ends both."""

    def __init__(self, host: str = "127.0.0.1", port: int = 9400, *, interval: float = 2.0,
                 hide_commands: bool = False, sampler: Sampler | None = None) -> None:
        self.host = host
        self.port = port
        self.interval = interval
        self.hide_commands = hide_commands
        self.sampler = sampler or Sampler(interval, hide_commands=hide_commands)
        self.static = _static_files()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._page_cache: tuple[object, bytes] | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The bound ``(address, port)`` (the real port when 0 was asked)."""
        if self._httpd is None:
            raise RuntimeError("not started")
        bound = self._httpd.server_address
        return str(bound[0]), int(bound[1])

    @property
    def url(self) -> str:
        address, port = self.address
        return f"http://[{address}]:{port}/" if ":" in address else f"http://{address}:{port}/"

    @property
    def loopback_only(self) -> bool:
        return is_loopback(self.address[0])

    def bind(self) -> None:
        """Resolve and bind (no sampling yet): a bad host or a busy port fails here, in one line."""
        family, address = resolve_host(self.host, self.port)
        try:
            self._httpd = _HTTPServer(self, (address, self.port), family)
        except OSError as exc:
            where = f"{self.host}:{self.port}"
            if exc.errno == errno.EADDRINUSE:
                raise ServeError(f"port {self.port} on {self.host} is in use by another program; "
                                 f"pick another with --port, or stop the one on {where}") from None
            if exc.errno == errno.EACCES:
                raise ServeError(f"no permission to listen on {where} (ports below 1024 need "
                                 "root); pick another with --port") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ServeError(f"--host {self.host!r} is not an address of this machine; "
                                 "use 127.0.0.1, 0.0.0.0 or one of its own addresses") from None
            raise ServeError(f"cannot listen on {where}: {exc.strerror or exc}") from None

    def start(self) -> None:
        """Bind, take the first sample, and serve in a background thread."""
        if self._httpd is None:
            self.bind()
        assert self._httpd is not None
        try:
            self.sampler.start()
        except BaseException:
            self._httpd.server_close()
            raise
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="devicekit-serve", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving, close the socket and stop the sampler."""
        if self._httpd is not None:
            if self._thread is not None:
                self._httpd.shutdown()
                self._thread.join(5)
            self._httpd.server_close()
        self.sampler.stop()

    def page(self) -> bytes:
        """The whole page for the current snapshot (built once per snapshot)."""
        from devicekit.serve.page import render_page

        snap = self.sampler.snapshot
        cached = self._page_cache
        if cached is not None and cached[0] is snap:
            return cached[1]
        body = render_page(snap.status, interval=self.interval,
                           fragment=snap.fragment_html.decode()).encode()
        self._page_cache = (snap, body)
        return body

    def __enter__(self) -> StatusServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
