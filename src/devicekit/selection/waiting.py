"""The progress line ``select_gpus(wait=...)`` shows on stderr while it waits for GPUs.

On a terminal it is a rich live line (spinner, time bar, how many GPUs are eligible and the
first reason the others are not); elsewhere it stays silent unless asked, so logs and
``$(devicekit select ...)`` stay clean. rich is imported only when the line is first shown.

Usage::

    display = WaitDisplay(count=2, wait=600, enabled=None)   # None: only on a terminal
    display.update(candidates, remaining=590.0)
    display.close()
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["WaitDisplay"]


class _Judged(Protocol):
    @property
    def eligible(self) -> bool: ...

    def line(self) -> str: ...


class WaitDisplay:
    """A live status line on stderr; a no-op when disabled."""

    def __init__(self, count: int | None, wait: float, *, enabled: bool | None = None) -> None:
        self.count = count
        self.wait = float(wait)
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._progress: Any = None
        self._task: Any = None

    def text(self, candidates: Sequence[_Judged], remaining: float) -> str:
        eligible = sum(c.eligible for c in candidates)
        asked = "all eligible" if self.count is None else str(self.count)
        blocked = next((c.line() for c in candidates if not c.eligible), "no GPUs found")
        return (f"waiting for {asked} GPU(s): {eligible} eligible, {remaining:.0f} s left "
                f"({blocked})")

    def update(self, candidates: Sequence[_Judged], remaining: float) -> None:
        if not self.enabled:
            return
        description = self.text(candidates, remaining)
        elapsed = max(self.wait - remaining, 0.0)
        if self._progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

            self._progress = Progress(
                SpinnerColumn(), BarColumn(bar_width=20), TextColumn("{task.description}"),
                console=Console(stderr=True), transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(description, total=self.wait or 1.0)
        self._progress.update(self._task, description=description, completed=elapsed)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
