"""What ``select_gpus(wait=...)`` (and so ``devicekit run --wait``) says on stderr while it waits.

On a terminal it is a rich live line (spinner, time bar, how many GPUs are eligible and the
first reason the others are not). Elsewhere (a file, ``nohup``, ``&``, a batch job's log) it
writes plain lines, as git's "waiting for lock" does, so a log tells waiting from hung: one when
the wait begins (with its ticket, its place in the queue and the reason), one on every change of
reason, and one every :data:`EVERY_SECONDS` in between. ``progress=False`` is silent. stdout is
never touched, so ``$(devicekit select --wait 600)`` stays clean. rich is imported only when the
live line is first shown.

Usage::

    display = WaitDisplay(count=2, wait=600, enabled=None)   # None: live line or plain lines
    display.update(candidates, remaining=590.0, ticket=ticket, look=look)
    display.close()
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import IO, Any, Protocol

from devicekit.hardware.printable import printable
from devicekit.units import format_duration

__all__ = ["WaitDisplay", "EVERY_SECONDS"]

#: seconds between plain lines while nothing changes
EVERY_SECONDS = 30.0


def _seconds(seconds: float) -> str:
    """``600 -> '600 s'`` (what --wait was given in); a wait past a million seconds in days
    (``'11d14h'``, ``'>9999d'`` for ``--wait 1e308``) rather than a 300-digit number."""
    return f"{seconds:.0f} s" if seconds < 1e6 else format_duration(seconds)


class _Judged(Protocol):
    @property
    def eligible(self) -> bool: ...

    def line(self) -> str: ...


class WaitDisplay:
    """A live status line on a terminal, plain lines elsewhere; a no-op when disabled."""

    def __init__(self, count: int | None, wait: float, *, enabled: bool | None = None,
                 stream: IO[str] | None = None, every: float = EVERY_SECONDS) -> None:
        self.count = count
        self.wait = float(wait)
        self.enabled = True if enabled is None else enabled
        self.every = every
        self._stream = stream
        isatty = getattr(self.stream, "isatty", None)
        self.terminal = bool(isatty and isatty())
        self._progress: Any = None
        self._task: Any = None
        self._started = time.monotonic()
        self._last_line: float | None = None
        self._last_reason: str | None = None

    @property
    def stream(self) -> IO[str]:
        return self._stream if self._stream is not None else sys.stderr

    def text(self, candidates: Sequence[_Judged], remaining: float) -> str:
        eligible = sum(c.eligible for c in candidates)
        asked = "all eligible" if self.count is None else str(self.count)
        return (f"waiting for {asked} GPU(s): {eligible} eligible, {_seconds(remaining)} left "
                f"({_first_blocked(candidates)})")

    def update(self, candidates: Sequence[_Judged], remaining: float, *, ticket: Any = None,
               look: Any = None) -> None:
        """Show the wait now; ``ticket`` and ``look`` (the queue's ticket, the machine as last
        seen) let a plain line give the ticket's place in the queue and the queue's reason."""
        if not self.enabled:
            return
        if self.terminal:
            self._live(candidates, remaining)
            return
        # with a ticket, the queue's own reason (the candidates' lines were judged before it joined)
        place = _place(ticket, look)
        reason = place[2] if place is not None else _first_blocked(candidates)
        now = time.monotonic()
        changed = reason != self._last_reason
        if self._last_line is not None and not changed and now - self._last_line < self.every:
            return
        first = self._last_line is None
        self._last_line, self._last_reason = now, reason
        self.stream.write(self.plain_line(candidates, remaining, ticket, place, first=first) + "\n")
        self.stream.flush()

    def plain_line(self, candidates: Sequence[_Judged], remaining: float, ticket: Any,
                   place: tuple[int, int, str] | None, *, first: bool) -> str:
        """One line for a log: the ticket, its place in the queue, the time, and why it waits."""
        asked = "every eligible GPU" if self.count is None else f"{self.count} GPU(s)"
        waited = time.monotonic() - self._started
        if place is not None:
            position, total, reason = place
            where = f"ticket {ticket.ticket}, {position} of {total} waiting"
        else:
            eligible = sum(c.eligible for c in candidates)
            where, reason = f"{eligible} eligible", _first_blocked(candidates)
        if first:
            head = f"devicekit: waiting for {asked} ({where}), up to {_seconds(remaining)}"
        else:
            head = f"devicekit: still waiting for {asked} ({where}), {_seconds(waited)} so far, {_seconds(remaining)} left"
        return printable(f"{head}: {reason}")

    def _live(self, candidates: Sequence[_Judged], remaining: float) -> None:
        description = self.text(candidates, remaining)
        elapsed = max(self.wait - remaining, 0.0)
        if self._progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

            self._progress = Progress(
                SpinnerColumn(), BarColumn(bar_width=20), TextColumn("{task.description}"),
                console=Console(file=self.stream), transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(description, total=self.wait or 1.0)
        self._progress.update(self._task, description=description, completed=elapsed)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _first_blocked(candidates: Sequence[_Judged]) -> str:
    return next((c.line() for c in candidates if not c.eligible), "no GPUs found")


def _place(ticket: Any, look: Any) -> tuple[int, int, str] | None:
    """(place in the queue from 1, tickets waiting, the queue's reason), or None without one."""
    if ticket is None or look is None:
        return None
    from devicekit.errors import DeviceKitError
    from devicekit.sharing.queue_state import look as queue_look

    try:
        view = queue_look(look.directory, look.devices, look.leases, policy=look.policy)
    except (DeviceKitError, OSError):
        return None
    for position, entry in enumerate(view.waiting, 1):
        if entry.record.path == str(ticket.path):
            return position, len(view.waiting), entry.decision.reason
    return None
