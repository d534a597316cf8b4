"""One sampler thread and its cached snapshot: the only code in ``devicekit serve`` that asks NVML.

Every ``interval`` seconds the sampler takes :func:`~devicekit.sharing.machine_status.collect_status`,
builds everything the server hands out from it (the ``status --json`` bytes, the Prometheus
text, the page's HTML fragment) and swaps the new :class:`Snapshot` in with one assignment.
Requests only read the latest snapshot, so a slow driver never blocks a client and a scrape
costs no NVML call. The first sample is taken in :meth:`Sampler.start`, so a broken simulation
file or driver is an error at start; a later failure keeps the last good snapshot and is shown
as ``error`` (page banner, ``devicekit_sample_ok 0``).

Usage::

    from devicekit.serve.sampler import Sampler

    sampler = Sampler(interval=2.0, hide_commands=False)
    sampler.start()                    # first sample now; then one every 2 s in a thread
    snap = sampler.snapshot            # .status_json, .metrics_text, .fragment_html, .error
    sampler.stop()
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from devicekit.errors import DeviceKitError
from devicekit.serve.hidden import hide_commands
from devicekit.serve.idle import IdleTracker

__all__ = ["Sampler", "Snapshot", "hide_commands"]


@dataclass(frozen=True)
class Snapshot:
    """Everything served, built from one status document."""

    #: the ``devicekit status --json`` document (with ``--hide-commands``: scrubbed by
    #: :func:`~devicekit.serve.hidden.hide_commands` before anything below was built from it)
    status: dict[str, Any]
    #: ``status`` as ``devicekit status --json`` prints it, UTF-8
    status_json: bytes
    #: Prometheus text exposition (format 0.0.4), UTF-8
    metrics_text: bytes
    #: the page's live part (escaped HTML), UTF-8
    fragment_html: bytes
    #: monotonic time the document was taken
    taken_monotonic: float
    #: why the latest sample failed (this snapshot is then the last good one); None when fine
    error: str | None = None
    #: samples that failed since the server started
    errors_total: int = 0


def _collect() -> dict[str, Any]:
    from devicekit.sharing.machine_status import collect_status

    return collect_status().to_dict()


class Sampler:
    """Takes the status every ``interval`` seconds in one daemon thread; serves the latest."""

    def __init__(self, interval: float = 2.0, *, hide_commands: bool = False,
                 collect: Callable[[], dict[str, Any]] = _collect) -> None:
        self.interval = interval
        self.hide_commands = hide_commands
        self._collect = collect
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._snapshot: Snapshot | None = None
        #: since when each lease's GPU has been idle (``idle_since`` in the served document)
        self._idle = IdleTracker()
        #: samples taken (successful or not); for tests and the benchmark
        self.samples = 0

    @property
    def snapshot(self) -> Snapshot:
        """The latest snapshot (one attribute read: safe from any thread)."""
        snap = self._snapshot
        if snap is None:
            raise RuntimeError("Sampler.start() takes the first sample; call it first")
        return snap

    def start(self) -> None:
        """Take the first sample now (its errors propagate) and start the thread."""
        self._snapshot = self.build(self._idle.annotate(self._collect()))
        self.samples = 1
        self._thread = threading.Thread(target=self._run, name="devicekit-serve-sampler",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (it finishes the sample it is taking, if any)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def sample_once(self) -> None:
        """Take one sample now; a failure keeps the last good document and records the error."""
        old = self.snapshot
        try:  # collecting and building both: whatever a lease file holds, the thread lives on
            self._snapshot = self.build(self._idle.annotate(self._collect()),
                                        errors_total=old.errors_total)
        except Exception as exc:  # any failure: the last good numbers stay, the error is shown
            text = str(exc).splitlines()[0][:300] if str(exc) else ""
            message = text if isinstance(exc, DeviceKitError) and text else (
                f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
            self._snapshot = self.build(old.status, error=message,
                                        errors_total=old.errors_total + 1, hidden=True)
        self.samples += 1

    def build(self, doc: dict[str, Any], *, error: str | None = None, errors_total: int = 0,
              hidden: bool = False) -> Snapshot:
        """Everything served, from one status document (``hidden``: commands already removed)."""
        from devicekit.serve.page import render_fragment
        from devicekit.serve.prometheus import render_metrics

        if self.hide_commands and not hidden:
            doc = hide_commands(doc)
        return Snapshot(
            status=doc,
            status_json=(json.dumps(doc, indent=2) + "\n").encode(),
            metrics_text=render_metrics(doc, sample_ok=error is None, sample_errors=errors_total),
            fragment_html=render_fragment(doc, error=error,
                                          hide_commands=self.hide_commands).encode(),
            taken_monotonic=time.monotonic(),
            error=error,
            errors_total=errors_total,
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample_once()
