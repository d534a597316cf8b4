"""The lab: several machines' ``devicekit serve`` read at once, each answer or the reason for none.

:class:`PeerReader` reads every peer's ``/api/status`` in parallel, one daemon thread per peer,
and waits at most the timeout (plus a moment) for all of them: a peer that never answers, or
whose name takes long to look up, costs its line ("no answer within 3 s"), never the others'.
A peer still being read from an earlier round is not read again until that read ends, so a
hanging peer holds one thread, not one per round. Each answer is decoded, checked and rebuilt
by :func:`~devicekit.serve.peer_document.decode_status` before anyone sees it, under the same
deadline as the read (a peer whose answer is not read and checked in time costs its line), one
answer at a time (decoding holds the GIL anyway; so a hostile body's objects exist once).

:func:`lab_document` is the JSON ``devicekit status --hosts --json`` prints and ``/api/lab``
serves: ``{"schema": 1, "taken_at", "hosts": [{"host", "url", "local", "ok", "error",
"fetched_at", "age", "status"}]}``. Its size has a ceiling: each host's ``status`` is at most
:data:`~devicekit.serve.peer_document.MAX_DOCUMENT` bytes of JSON (checked as it is decoded), and
once the hosts' documents together pass :data:`MAX_LAB_BYTES` the hosts after that are listed
with an error instead of their status. :func:`lab_json` encodes it (msgspec, in C).

Usage::

    from devicekit.serve.lab import PeerReader, lab_document
    from devicekit.serve.peer_fetch import PeerAddress

    peers = [PeerAddress.parse(h) for h in ("gpu1:9400", "gpu2:9400")]
    answers = PeerReader().read(peers, timeout=3.0)
    for a in answers:
        print(a.peer.label, len(a.status["gpus"]) if a.status else a.error)
    doc = lab_document(answers)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from devicekit.serve.peer_document import decode_status
from devicekit.serve.peer_fetch import PeerAddress, PeerError, fetch_body

__all__ = ["HostAnswer", "PeerReader", "lab_document", "lab_json", "LAB_SCHEMA", "MAX_PEERS",
           "MAX_LAB_BYTES", "DEFAULT_TIMEOUT"]

LAB_SCHEMA = 1
#: the most hosts one lab view reads
MAX_PEERS = 256
#: seconds each host has to answer, unless told otherwise
DEFAULT_TIMEOUT = 3.0
#: the hosts' status documents in one lab document, together (JSON bytes)
MAX_LAB_BYTES = 16 * 1024 * 1024
#: how much longer than the timeout the reader waits for a thread before it stops waiting
_GRACE = 0.25

Fetch = Callable[[PeerAddress, float], dict[str, Any]]
_DECODING = threading.Lock()


def fetch_status(peer: PeerAddress, timeout: float) -> dict[str, Any]:
    """One peer's checked status document, read and checked within ``timeout``;
    :class:`PeerError` saying why not."""
    deadline = time.monotonic() + timeout
    body = fetch_body(peer, "/api/status", timeout=timeout)
    # one document decoded at a time: decoding holds the GIL anyway, and so the objects a
    # hostile 4 MiB body builds before it is refused (~6x its size) exist once, not per peer
    if not _DECODING.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
        raise PeerError(f"answer not checked within {timeout:g} s (other hosts' answers were)")
    try:
        doc = decode_status(body)
    finally:
        _DECODING.release()
    if time.monotonic() > deadline:
        raise PeerError(f"answer not read and checked within {timeout:g} s")
    return doc


@dataclass(frozen=True)
class HostAnswer:
    """One host's part of the lab: its status document (or None), and why not when it failed.

    ``status`` may be older than ``error`` (serve keeps a peer's last good document when a
    later read fails); ``fetched_at`` is when ``status`` was read (seconds since the epoch).
    """

    peer: PeerAddress | None
    status: dict[str, Any] | None
    error: str | None = None
    fetched_at: float | None = None
    #: this host is the serving machine itself (``/api/lab``), not a peer
    local: bool = False

    @property
    def ok(self) -> bool:
        return self.status is not None and self.error is None

    @property
    def label(self) -> str:
        if self.peer is not None:
            return self.peer.label
        host = (self.status or {}).get("host") or {}
        return str(host.get("hostname") or "this machine")

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        return {
            "host": self.label,
            "url": None if self.peer is None else self.peer.url("/"),
            "local": self.local,
            "ok": self.ok,
            "error": self.error,
            "fetched_at": self.fetched_at,
            "age": None if self.fetched_at is None else round(max(now - self.fetched_at, 0.0), 3),
            "status": self.status,
        }


class PeerReader:
    """Reads peers in parallel; remembers which reads are still running (see the module doc)."""

    def __init__(self, fetch: Fetch = fetch_status) -> None:
        self._fetch = fetch
        self._running: dict[PeerAddress, threading.Thread] = {}
        self._lock = threading.Lock()

    def read(self, peers: Sequence[PeerAddress], timeout: float = DEFAULT_TIMEOUT
             ) -> list[HostAnswer]:
        """Every peer's answer, in the order given, within ``timeout`` (and a moment)."""
        results: dict[PeerAddress, HostAnswer] = {}
        started: list[threading.Thread] = []
        for peer in dict.fromkeys(peers):
            with self._lock:
                if peer in self._running:
                    results[peer] = HostAnswer(peer, None, "still not answering an earlier read")
                    continue
                thread = threading.Thread(target=self._one, args=(peer, timeout, results),
                                          name=f"devicekit-lab-{peer.label}", daemon=True)
                self._running[peer] = thread
            thread.start()
            started.append(thread)
        deadline = time.monotonic() + timeout + _GRACE
        for thread in started:
            thread.join(max(deadline - time.monotonic(), 0.0))
        out = []
        for peer in peers:
            answer = results.get(peer)
            out.append(answer if answer is not None else
                       HostAnswer(peer, None, f"no answer within {timeout:g} s"))
        return out

    def _one(self, peer: PeerAddress, timeout: float, results: dict[PeerAddress, HostAnswer]
             ) -> None:
        try:
            doc = self._fetch(peer, timeout)
        except PeerError as exc:
            results[peer] = HostAnswer(peer, None, str(exc))
        except Exception as exc:  # anything else a hostile answer causes: its line, not a crash
            results[peer] = HostAnswer(peer, None, f"unreadable answer ({type(exc).__name__})")
        else:
            results[peer] = HostAnswer(peer, doc, None, time.time())
        finally:
            with self._lock:
                self._running.pop(peer, None)


def lab_document(answers: Sequence[HostAnswer], *, now: float | None = None) -> dict[str, Any]:
    """The lab's JSON: every host's answer and error (see the module doc)."""
    now = time.time() if now is None else now
    hosts, total = [], 0
    for answer in answers:
        host = answer.to_dict(now)
        if host["status"] is not None and not answer.local:
            total += len(msgspec.json.encode(host["status"]))
            if total > MAX_LAB_BYTES:
                host.update(status=None, ok=False, error=(
                    f"left out: the hosts before it fill the lab's {MAX_LAB_BYTES >> 20} MiB"))
        hosts.append(host)
    return {"schema": LAB_SCHEMA, "taken_at": now, "hosts": hosts}


def lab_json(lab: dict[str, Any], *, indent: int = 2) -> bytes:
    """The lab document as JSON (UTF-8, a final newline), in time linear in its size."""
    return msgspec.json.format(msgspec.json.encode(lab), indent=indent) + b"\n"
