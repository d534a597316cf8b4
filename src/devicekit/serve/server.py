"""The HTTP server of ``devicekit serve``: read-only, cached, one thread serving all connections.

Routes (GET and HEAD only; anything else is 405, an unknown path 404):

- ``/``: the status page; ``/fragment``: its live part; ``/static/page.css``, ``/static/page.js``
- ``/metrics``: Prometheus text format
- ``/api/status``: the ``devicekit status --json`` document
- ``/lab``: the lab page (this host and every ``--peer``); ``/lab/fragment``: its live part;
  ``/api/lab``: the lab document (every host's status, age and error)

Every response is bytes the :class:`~devicekit.serve.sampler.Sampler` built at its last sample,
so a request never waits for NVML; the lab's bytes are the
:class:`~devicekit.serve.lab_poller.LabPoller`'s, built in its own thread, so a request never
waits for a peer either. Connections are served by one non-blocking selector thread
(:mod:`~devicekit.serve.connections`): an idle socket costs no thread, a connection must send
its request head within a few seconds, and someone who holds many idle sockets only loses the
oldest of them to newcomers. A request whose ``Host`` or ``Origin`` names a host the server is
not known by gets 403 (:mod:`~devicekit.serve.hosts`: no DNS rebinding). Nothing a request says
is executed or stored.

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
from collections.abc import Iterable
from importlib import resources

from devicekit.errors import ServeError
from devicekit.serve.connections import ConnectionLoop, Limits
from devicekit.serve.hosts import HostPolicy
from devicekit.serve.http_messages import Request, Response
from devicekit.serve.lab import DEFAULT_TIMEOUT
from devicekit.serve.lab_poller import LabPoller
from devicekit.serve.peer_fetch import PeerAddress
from devicekit.serve.prometheus import CONTENT_TYPE as METRICS_TYPE
from devicekit.serve.sampler import Sampler

__all__ = ["StatusServer", "Limits", "is_loopback", "resolve_host"]

#: pending connections the kernel keeps for the serving thread to accept
_BACKLOG = 1024
_HTML = "text/html; charset=utf-8"
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


class StatusServer:
    """The sampler and the HTTP server together; :meth:`start` binds, :meth:`stop` ends both.

    ``allow_hosts``: names besides the defaults that a request's ``Host`` may carry (the CLI's
    ``--allow-host``); ``limits``: connection limits and timeouts (tests shrink them);
    ``peers``: other hosts' ``devicekit serve`` for the lab view (the CLI's ``--peer``), read
    every interval, each given ``peer_timeout`` seconds.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 9400, *, interval: float = 2.0,
                 hide_commands: bool = False, sampler: Sampler | None = None,
                 allow_hosts: Iterable[str] = (), limits: Limits | None = None,
                 peers: Iterable[PeerAddress] = (), peer_timeout: float = DEFAULT_TIMEOUT) -> None:
        self.host = host
        self.port = port
        self.interval = interval
        self.hide_commands = hide_commands
        self.allow_hosts = tuple(allow_hosts)
        self.limits = limits or Limits()
        self.sampler = sampler or Sampler(interval, hide_commands=hide_commands)
        self.static = _static_files()
        self.lab = LabPoller(list(peers), self.sampler, interval=interval, timeout=peer_timeout,
                             hide_commands=hide_commands)
        self.hosts: HostPolicy | None = None
        self.loop: ConnectionLoop | None = None
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._page_cache: tuple[object, bytes] | None = None
        self._lab_cache: tuple[object, bytes] | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The bound ``(address, port)`` (the real port when 0 was asked)."""
        if self._listener is None:
            raise RuntimeError("not started")
        bound = self._listener.getsockname()
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
        hosts = HostPolicy.for_bind(address, self.allow_hosts)  # a bad --allow-host: one line
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart: same port
            listener.bind((address, self.port))
            listener.listen(_BACKLOG)
        except OSError as exc:
            listener.close()
            raise _bind_error(exc, self.host, self.port) from None
        self._listener, self.hosts = listener, hosts
        self.loop = ConnectionLoop(listener, self.answer, self.limits)

    def start(self) -> None:
        """Bind, take the first sample, and serve in a background thread."""
        if self._listener is None:
            self.bind()
        assert self._listener is not None and self.loop is not None
        try:
            self.sampler.start()
            self.lab.start()
        except BaseException:
            self._listener.close()
            self.sampler.stop()
            raise
        self._thread = threading.Thread(target=self.loop.run, name="devicekit-serve", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving, close every connection and the socket, and stop the sampler."""
        if self.loop is not None:
            self.loop.stop()
            if self._thread is not None:
                self._thread.join(5)
        if self._listener is not None:
            self._listener.close()
        self.lab.stop()
        self.sampler.stop()

    def answer(self, request: Request) -> Response:
        """The response to one request (called by the serving thread only)."""
        refusal = self.hosts.refusal(request.headers.get("Host"), request.headers.get("Origin")) \
            if self.hosts is not None else None
        if refusal is not None:
            return Response(403, refusal.encode())
        if request.method not in ("GET", "HEAD"):
            return Response(405, b"read-only: only GET and HEAD\n", headers={"Allow": "GET, HEAD"})
        path = request.path
        snap = self.sampler.snapshot
        if path == "/metrics":
            return Response(200, snap.metrics_text, METRICS_TYPE)
        if path == "/api/status":
            return Response(200, snap.status_json, "application/json")
        if path == "/fragment":
            return Response(200, snap.fragment_html, _HTML)
        if path in ("/", "/index.html"):
            return Response(200, self.page(), _HTML)
        if path == "/api/lab":
            return Response(200, self.lab.snapshot.lab_json, "application/json")
        if path == "/lab/fragment":
            return Response(200, self.lab.snapshot.fragment_html, _HTML)
        if path in ("/lab", "/lab/"):
            return Response(200, self.lab_page(), _HTML)
        if path in self.static:
            body, kind = self.static[path]
            return Response(200, body, kind)
        return Response(404, b"not found: try /, /lab, /metrics, /api/status or /api/lab\n")

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

    def lab_page(self) -> bytes:
        """The whole lab page for the current lab snapshot (built once per snapshot)."""
        from devicekit.serve.lab_page import render_lab_page

        snap = self.lab.snapshot
        cached = self._lab_cache
        if cached is not None and cached[0] is snap:
            return cached[1]
        own = self.sampler.snapshot.status
        body = render_lab_page(snap.lab, interval=self.interval,
                               fragment=snap.fragment_html.decode(),
                               title=str(own.get("host", {}).get("hostname", "")),
                               version=str(own.get("devicekit_version", ""))).encode()
        self._lab_cache = (snap, body)
        return body

    def __enter__(self) -> StatusServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _bind_error(exc: OSError, host: str, port: int) -> ServeError:
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return ServeError(f"port {port} on {host} is in use by another program; "
                          f"pick another with --port, or stop the one on {where}")
    if exc.errno == errno.EACCES:
        return ServeError(f"no permission to listen on {where} (ports below 1024 need "
                          "root); pick another with --port")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ServeError(f"--host {host!r} is not an address of this machine; "
                          "use 127.0.0.1, 0.0.0.0 or one of its own addresses")
    return ServeError(f"cannot listen on {where}: {exc.strerror or exc}")
