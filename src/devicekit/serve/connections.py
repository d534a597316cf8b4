"""The connections of ``devicekit serve``: one selector thread, never a thread per client.

One thread accepts, reads request heads, answers them (from the sampler's cached bytes, through
the ``answer`` function it is given) and writes, all non-blocking (:mod:`selectors`), so a
connection that sends nothing costs a file descriptor and a few hundred bytes, not a thread.
Limits (:class:`Limits`):

- ``head_timeout`` (3 s): from connect, or from the first byte of a keep-alive connection's next
  request, to the end of the request head; ``keepalive_timeout`` (15 s): idle between requests;
  ``write_timeout`` (15 s): an answer the client does not take;
- ``connections`` open at once (fewer when the open-files limit is low) and ``per_client`` per
  remote address (an IPv6 /64); every loopback address counts as one client, since all local
  users connect from 127.0.0.1.

At a limit a new connection is never refused: the oldest *idle* connection is closed instead,
first one still waiting for its request head with no byte waiting to be read, then a keep-alive
one between requests. At the per-client limit it is one of that client's; at the global limit
one of the newcomer's own client when that holds its fair share or more, else anyone's. A
client that sends its request as soon as it connects, as every HTTP client does, is answered
however many idle sockets someone else holds; whoever holds them loses their oldest.

Usage::

    from devicekit.serve.connections import ConnectionLoop
    from devicekit.serve.http_messages import Response

    loop = ConnectionLoop(listening_socket, lambda request: Response(200, b"hello\\n"))
    threading.Thread(target=loop.run).start()
    ...
    loop.stop()            # from any thread; run() closes every connection and returns
"""

from __future__ import annotations

import errno
import ipaddress
import resource
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from devicekit.serve.http_messages import (
    MAX_HEAD_BYTES,
    BadRequest,
    Request,
    Response,
    head_end,
    parse_request,
    response_head,
)

__all__ = ["ConnectionLoop", "Limits", "client_key", "connection_cap"]

#: how many new connections one wake-up accepts before it reads the others again
ACCEPT_BATCH = 128
#: how many of the oldest waiting connections an eviction checks for bytes already sent
_PEEKS = 8
_READING, _IDLE, _WRITING = "reading", "idle", "writing"
_RETRY_ACCEPT = 0.1  # seconds without accepting when no file descriptor is left to free
_RECV = 16 * 1024  # bytes read at a time: a connection buffers at most MAX_HEAD_BYTES + this


@dataclass(frozen=True)
class Limits:
    """How many connections, and how long each may take (defaults: see the module docstring)."""

    connections: int = 1024
    per_client: int = 128
    head_timeout: float = 3.0
    keepalive_timeout: float = 15.0
    write_timeout: float = 15.0


def connection_cap(wanted: int) -> int:
    """``wanted``, or half the process's open-files limit when that is lower (but at least 16):
    the other half stays for the sampler, the lease directory and whatever else is open."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max(wanted, 1)
    return max(min(wanted, max(16, soft // 2)), 1)


def client_key(address: str) -> str:
    """Whose connection this is: ``loopback`` for every local address, an IPv6 /64, or the IPv4."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class _Conn:
    __slots__ = ("sock", "fd", "client", "state", "since", "buffer", "scanned", "out",
                 "close_after", "closed")

    def __init__(self, sock: socket.socket, client: str, now: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.client = client
        self.state = _READING
        self.since = now
        self.buffer = bytearray()
        self.scanned = 0  # bytes of the buffer known to hold no end of a request head
        self.out: list[memoryview] = []
        self.close_after = False
        self.closed = False


_States = dict[str, dict[int, _Conn]]  # state -> {fd: connection}, oldest first


def _states() -> _States:
    return {_READING: {}, _IDLE: {}, _WRITING: {}}


class ConnectionLoop:
    """Serves every connection of one listening socket from one thread (see the module doc)."""

    _selector: selectors.BaseSelector  # made by run(), used only inside it

    def __init__(self, listener: socket.socket, answer: Callable[[Request], Response],
                 limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.cap = connection_cap(self.limits.connections)
        self.per_client = min(self.limits.per_client, self.cap)
        self._timeouts = {_READING: self.limits.head_timeout, _IDLE: self.limits.keepalive_timeout,
                          _WRITING: self.limits.write_timeout}
        self._listener = listener
        listener.setblocking(False)
        self._answer = answer
        self._wake: tuple[socket.socket, socket.socket] | None = None  # made by run()
        self._stopping = False
        self._all = _states()
        self._clients: dict[str, _States] = {}
        self._paused_until: float | None = None
        #: counters for tests and benchmarks: accepted, answered, evicted, timed_out
        self.counts = {"accepted": 0, "answered": 0, "evicted": 0, "timed_out": 0}

    @property
    def open_connections(self) -> int:
        return sum(len(group) for group in self._all.values())

    def stop(self) -> None:
        """Ask :meth:`run` to close everything and return (safe from any thread)."""
        self._stopping = True
        wake = self._wake
        if wake is not None:
            try:
                wake[1].send(b"x")
            except OSError:
                pass  # run() checks the flag at least once a second anyway

    def run(self) -> None:
        """Serve until :meth:`stop`; closes every connection (not the listener) on the way out."""
        selector = self._selector = selectors.DefaultSelector()
        wake = socket.socketpair()
        for sock in wake:
            sock.setblocking(False)
        self._wake = wake
        selector.register(self._listener, selectors.EVENT_READ, None)
        selector.register(wake[0], selectors.EVENT_READ, "wake")
        try:
            while not self._stopping:
                now = time.monotonic()
                if self._paused_until is not None and now >= self._paused_until:
                    selector.register(self._listener, selectors.EVENT_READ, None)
                    self._paused_until = None
                accept = False
                for key, mask in selector.select(self._wait(now)):
                    if key.data is None:
                        accept = True  # after the connections already open have been read
                    elif key.data == "wake":
                        self._drain_wake()
                    elif not key.data.closed:
                        self._event(key.data, mask)
                if accept and not self._stopping:
                    self._accept()
                self._expire(time.monotonic())
        finally:
            for group in self._all.values():
                for conn in list(group.values()):
                    self._close(conn)
            selector.close()
            self._wake = None
            for sock in wake:
                sock.close()

    # accepting --------------------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    victim = self._victim(self._all)
                    if victim is None:  # nothing to free: stop accepting for a moment
                        self._selector.unregister(self._listener)
                        self._paused_until = time.monotonic() + _RETRY_ACCEPT
                        return
                    self._evict(victim)
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue
                return
            self._admit(sock, address)

    def _admit(self, sock: socket.socket, address: object) -> None:
        host = address[0] if isinstance(address, tuple) and address else str(address)
        key = client_key(str(host))
        mine = self._clients.get(key)
        limit = self.cap if key == "loopback" else self.per_client
        held = sum(len(group) for group in mine.values()) if mine is not None else 0
        if mine is not None and held >= limit:
            self._evict(self._victim(mine))
        elif self.open_connections >= self.cap:
            # a client holding its fair share or more makes room itself; a light one takes the
            # oldest idle connection of anyone (most likely of whoever holds the most)
            fair = self.cap // max(len(self._clients), 1)
            self._evict(self._victim(mine if mine is not None and held >= fair else self._all))
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            sock.close()
            return
        conn = _Conn(sock, key, time.monotonic())
        self._selector.register(sock, selectors.EVENT_READ, conn)
        self._all[_READING][conn.fd] = conn
        self._clients.setdefault(key, _states())[_READING][conn.fd] = conn
        self.counts["accepted"] += 1

    def _victim(self, states: _States) -> _Conn | None:
        """The connection to close for a new one: the oldest still waiting for its request head
        with nothing arrived to read, else the oldest keep-alive one, else the oldest at all."""
        for checked, conn in enumerate(states[_READING].values()):
            if checked >= _PEEKS:
                break
            if not _bytes_waiting(conn.sock):
                return conn
        for state in (_IDLE, _READING, _WRITING):
            for conn in states[state].values():
                return conn
        return None

    def _evict(self, conn: _Conn | None) -> None:
        if conn is not None:
            self._close(conn)
            self.counts["evicted"] += 1

    # reading and answering --------------------------------------------------------------------

    def _event(self, conn: _Conn, mask: int) -> None:
        if conn.state == _WRITING:
            if mask & selectors.EVENT_WRITE and self._send(conn) and conn.buffer:
                self._answer_buffered(conn)  # requests the client sent while it read
            return
        try:
            data = conn.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            self._close(conn)
            return
        if conn.state == _IDLE:
            self._move(conn, _READING)  # a new request: its head has head_timeout from now
        conn.buffer += data
        self._answer_buffered(conn)

    def _answer_buffered(self, conn: _Conn) -> None:
        """Answer every complete request head in the buffer, until one cannot be sent at once."""
        while not conn.closed:
            end = head_end(conn.buffer, max(conn.scanned - 3, 0))  # new bytes only: no O(n²)
            if end < 0 and len(conn.buffer) <= MAX_HEAD_BYTES:
                conn.scanned = len(conn.buffer)
                return  # wait for the rest of the head
            if end < 0 or end > MAX_HEAD_BYTES:
                self._respond(conn, Response(431, b"request head too large\n"), keep_alive=False)
                return
            head = bytes(conn.buffer[:end])
            del conn.buffer[:end]
            conn.scanned = 0
            try:
                request = parse_request(head)
            except BadRequest as exc:
                self._respond(conn, Response(exc.status, exc.body.encode()), keep_alive=False)
                return
            try:
                response = self._answer(request)
            except Exception:  # a bug in a route: the client gets 500, the server lives on
                response = Response(500, b"internal error\n")
            self.counts["answered"] += 1
            if not self._respond(conn, response, keep_alive=request.keep_alive,
                                 send_body=request.method != "HEAD",
                                 http10=request.version == "HTTP/1.0"):
                return

    def _respond(self, conn: _Conn, response: Response, *, keep_alive: bool,
                 send_body: bool = True, http10: bool = False) -> bool:
        """Queue the answer and send what the socket takes; True when all of it went out and
        the connection stays open."""
        head = response_head(response, keep_alive=keep_alive, http10=http10)
        conn.out = [memoryview(head)]
        if send_body and response.body:
            conn.out.append(memoryview(response.body))  # the cached bytes themselves, no copy
        conn.close_after = not keep_alive
        return self._send(conn)

    def _send(self, conn: _Conn) -> bool:
        sent_any = False
        try:
            while conn.out:
                sent = conn.sock.sendmsg(conn.out)
                sent_any = sent_any or sent > 0
                while sent and conn.out:
                    first = conn.out[0]
                    if sent >= len(first):
                        sent -= len(first)
                        conn.out.pop(0)
                    else:
                        conn.out[0] = first[sent:]
                        sent = 0
        except (BlockingIOError, InterruptedError):
            if conn.state != _WRITING:
                self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
                self._move(conn, _WRITING)
            elif sent_any:
                self._move(conn, _WRITING)  # progress: the write timeout starts again
            return False
        except OSError:
            self._close(conn)
            return False
        if conn.close_after:
            self._close(conn)
            return False
        if conn.state == _WRITING:
            self._selector.modify(conn.sock, selectors.EVENT_READ, conn)
        self._move(conn, _READING if conn.buffer else _IDLE)
        return True

    # bookkeeping ------------------------------------------------------------------------------

    def _move(self, conn: _Conn, state: str) -> None:
        """Put ``conn`` in ``state`` as its newest member (the state's clock starts now)."""
        mine = self._clients[conn.client]
        del self._all[conn.state][conn.fd]
        del mine[conn.state][conn.fd]
        conn.state = state
        conn.since = time.monotonic()
        self._all[state][conn.fd] = conn
        mine[state][conn.fd] = conn

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._all[conn.state].pop(conn.fd, None)
        mine = self._clients.get(conn.client)
        if mine is not None:
            mine[conn.state].pop(conn.fd, None)
            if not any(mine.values()):
                del self._clients[conn.client]
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        conn.out = []

    def _expire(self, now: float) -> None:
        for state, timeout in self._timeouts.items():
            group = self._all[state]
            while group:
                conn = next(iter(group.values()))
                if conn.since + timeout > now:
                    break
                self._close(conn)
                self.counts["timed_out"] += 1

    def _wait(self, now: float) -> float:
        """Seconds until the next deadline (a connection's, or the end of an accept pause)."""
        wait = 1.0
        for state, timeout in self._timeouts.items():
            group = self._all[state]
            if group:
                wait = min(wait, next(iter(group.values())).since + timeout - now)
        if self._paused_until is not None:
            wait = min(wait, self._paused_until - now)
        return max(wait, 0.0)

    def _drain_wake(self) -> None:
        try:
            while self._wake is not None and self._wake[0].recv(64):
                pass
        except OSError:
            pass


def _bytes_waiting(sock: socket.socket) -> bool:
    """Whether the client has sent bytes not read yet (a hang-up or an error counts as none)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except OSError:  # BlockingIOError included: nothing there
        return False
