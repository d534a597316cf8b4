"""A status line on stderr for the phases of a command a person (or a log) waits on.

``estimate``, ``advise``, ``bench`` and ``doctor`` spend seconds, on a busy machine minutes,
importing torch, building a model or measuring. :class:`PhaseStatus` says what runs once a
phase has lasted :data:`AFTER_SECONDS` (2 s; ``DEVICEKIT_STATUS_AFTER`` changes it): on a
terminal a rich spinner line that goes away when the command ends; elsewhere (a file, a pipe,
``nohup``) one plain line, ``devicekit estimate: building the model (2 s so far)``, then one
every :data:`EVERY_SECONDS` while the same phase runs, and one for a new phase once it has run
for the threshold too (or, for many short phases, once three times that passed since the last).
Nothing is printed for a command that answers within the threshold. stdout is never touched.

Usage::

    with PhaseStatus("estimate") as status:
        status.phase("importing torch and devicekit")
        import torch
        status.phase("building the model")
        model = build()
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from typing import IO, Any

__all__ = ["PhaseStatus", "AFTER_SECONDS", "EVERY_SECONDS", "AFTER_ENV"]

#: seconds a phase runs before it is shown
AFTER_SECONDS = 2.0
#: seconds between plain lines while one phase goes on
EVERY_SECONDS = 15.0
#: environment variable overriding :data:`AFTER_SECONDS` (seconds, >= 0)
AFTER_ENV = "DEVICEKIT_STATUS_AFTER"
_TICK = 0.1


def _after_from_env() -> float:
    raw = os.environ.get(AFTER_ENV, "")
    try:
        value = float(raw)
    except ValueError:
        return AFTER_SECONDS
    return value if math.isfinite(value) and value >= 0 else AFTER_SECONDS


class PhaseStatus:
    """Shows the current phase of ``command`` on stderr once it has lasted a while."""

    def __init__(self, command: str, *, stream: IO[str] | None = None, after: float | None = None,
                 every: float = EVERY_SECONDS, terminal: bool | None = None) -> None:
        self.command = command
        self._stream = stream
        self.after = _after_from_env() if after is None else after
        self.every = every
        self._terminal = terminal
        self._lock = threading.Lock()
        self._text = ""
        self._since = time.monotonic()
        self._shown = ""  # the phase last printed (plain) or shown (terminal)
        self._last_line = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._live: Any = None

    @property
    def stream(self) -> IO[str]:
        return self._stream if self._stream is not None else sys.stderr

    def __enter__(self) -> PhaseStatus:
        if self._terminal is None:
            isatty = getattr(self.stream, "isatty", None)
            self._terminal = bool(isatty and isatty())
        self._last_line = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="devicekit-status", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def phase(self, text: str) -> None:
        """The phase that runs from now (shown only if it lasts)."""
        with self._lock:
            self._text = text
            self._since = time.monotonic()

    def close(self) -> None:
        """Stop the line (a terminal's spinner goes away); safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            if self._live is not None:
                self._live.stop()
                self._live = None

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(_TICK):
            with self._lock:
                if self._stop.is_set():
                    return
                self._tick(time.monotonic())

    def _tick(self, now: float) -> None:
        text, age = self._text, now - self._since
        if not text:
            return
        if self._terminal:
            if self._live is None and age >= self.after:
                self._start_live(text)
            elif self._live is not None and text != self._shown:
                self._live.update(self._spinner(text))
                self._shown = text
            return
        quiet = now - self._last_line
        repeat = text == self._shown
        if not repeat:
            due = age >= self.after or quiet >= 3 * self.after  # many short phases: one now and then
        else:
            due = quiet >= self.every
        if due:
            self._shown, self._last_line = text, now
            so_far = f" ({age:.0f} s so far)" if age >= 1 or repeat else ""
            self.stream.write(f"devicekit {self.command}: {text}{so_far}\n")
            self.stream.flush()

    def _spinner(self, text: str) -> Any:
        from rich.spinner import Spinner

        return Spinner("dots", text=f"{self.command}: {text}")

    def _start_live(self, text: str) -> None:
        from rich.console import Console
        from rich.live import Live

        console = Console(file=self.stream, force_terminal=True, highlight=False)
        # stdout is the command's own: never redirected into the status line's stream
        self._live = Live(self._spinner(text), console=console, transient=True,
                          redirect_stdout=False, redirect_stderr=False, refresh_per_second=8)
        self._live.start()
        self._shown = text
