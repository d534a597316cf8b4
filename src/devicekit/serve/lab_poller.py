"""``devicekit serve --peer``: the peers read every interval in a thread of their own.

:class:`LabPoller` reads every peer's ``/api/status`` each interval (through
:class:`~devicekit.serve.lab.PeerReader`: in parallel, bounded by a timeout, a hanging peer
holding one thread at most), keeps each peer's last good answer with when it came and the
latest error, and builds the lab's bytes once per round, with this server's own latest
snapshot as the first host: ``/api/lab``'s JSON and the lab page's live part. Requests only
read the latest :class:`LabSnapshot`, so a slow or dead peer never holds a request, nor the
sampler. With ``hide_commands`` the peers' documents are scrubbed like this server's own.

Usage::

    from devicekit.serve.lab_poller import LabPoller
    from devicekit.serve.peer_fetch import PeerAddress

    poller = LabPoller([PeerAddress.parse("gpu2:9400")], sampler, interval=2.0)
    poller.start()                 # the first round runs in the thread, not here
    poller.snapshot.lab_json       # bytes for /api/lab
    poller.stop()
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from devicekit.serve.hidden import hide_commands as scrub_commands
from devicekit.serve.lab import DEFAULT_TIMEOUT, HostAnswer, PeerReader, lab_document, lab_json
from devicekit.serve.peer_fetch import PeerAddress
from devicekit.serve.sampler import Sampler

__all__ = ["LabPoller", "LabSnapshot"]


@dataclass(frozen=True)
class LabSnapshot:
    """The lab as served, built once per round."""

    #: the lab document (``/api/lab``'s content)
    lab: dict[str, Any]
    #: ``lab`` as JSON, UTF-8
    lab_json: bytes
    #: the lab page's live part (escaped HTML), UTF-8
    fragment_html: bytes
    #: rounds of reading the peers so far
    rounds: int


class LabPoller:
    """Reads the peers every ``interval`` seconds in one daemon thread; serves the latest."""

    def __init__(self, peers: Sequence[PeerAddress], sampler: Sampler, *, interval: float = 2.0,
                 timeout: float = DEFAULT_TIMEOUT, hide_commands: bool = False,
                 reader: PeerReader | None = None) -> None:
        self.peers = list(dict.fromkeys(peers))
        self.sampler = sampler
        self.interval = interval
        self.timeout = timeout
        self.hide_commands = hide_commands
        self._reader = reader or PeerReader()
        self._answers = [HostAnswer(p, None, "not read yet") for p in self.peers]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._snapshot: LabSnapshot | None = None
        self.rounds = 0
        #: why the latest round could not rebuild the lab (None: it did)
        self.error: str | None = None

    @property
    def snapshot(self) -> LabSnapshot:
        """The latest lab (this server's own part as of the latest round)."""
        snap = self._snapshot
        if snap is None:
            raise RuntimeError("LabPoller.start() builds the first lab; call it first")
        return snap

    def start(self) -> None:
        """Build the lab with the peers not read yet, then read them in the thread."""
        self._snapshot = self.build()
        self._thread = threading.Thread(target=self._run, name="devicekit-serve-lab", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def poll_once(self) -> None:
        """Read every peer once and rebuild the lab (a failed read keeps the last good answer)."""
        fresh = self._reader.read(self.peers, self.timeout) if self.peers else []
        merged = []
        for old, new in zip(self._answers, fresh, strict=True):
            if new.status is None and old.status is not None:
                new = replace(old, error=new.error)  # stale but shown, with the latest error
            elif new.status is not None and self.hide_commands:
                new = replace(new, status=scrub_commands(new.status))
            merged.append(new)
        self._answers = merged
        self.rounds += 1
        self._snapshot = self.build()

    def build(self) -> LabSnapshot:
        """The lab's bytes from this server's latest snapshot and the peers' latest answers."""
        from devicekit.serve.lab_page import render_lab_fragment

        snap = self.sampler.snapshot
        own = HostAnswer(None, snap.status, snap.error,
                         time.time() - (time.monotonic() - snap.taken_monotonic), local=True)
        lab = lab_document([own, *self._answers])
        return LabSnapshot(lab=lab, lab_json=lab_json(lab),
                           fragment_html=render_lab_fragment(lab).encode(), rounds=self.rounds)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.poll_once()
                self.error = None
            except Exception as exc:  # the thread lives on; the last lab stays served
                self.error = f"{type(exc).__name__}: {exc}"
            self._stop.wait(max(self.interval - (time.monotonic() - started), 0.05))
