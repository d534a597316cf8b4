"""Leak checks on a schedule, for a training loop that a framework runs (not the user).

The leak finder (:class:`devicekit.LeakDetector`) names holders after the variables of the
frame that calls ``step()``. Inside a framework that frame is the callback's, so
:class:`LeakWatch` calls ``step()`` from a frame whose only variables are the ones the user
wrote the loop with: ``self`` (the LightningModule, or the HF Trainer subclass) and ``model``.
A list the module keeps, ``self.loss_history``, is then reported under that name, with the line
that grew it and the fix, exactly as ``dk.find_leaks`` reports a plain loop.

A window is ``steps`` measured steps after one baseline step: the first window starts at the
first step, and with ``every=M`` another starts every ``M`` steps. The detector is started at
the baseline (``LeakDetector.start``), so it also searches from the memory (tensors a step left
alive, walked back to a name: a hook registered in every ``training_step``), exactly as
``dk.find_leaks`` does; it is stopped when the window ends or training fails, which gives the
garbage collector back. Each leak of a window is issued once as a :class:`devicekit.LeakWarning`.

Usage::

    watch = LeakWatch(steps=6, every=None)
    for step in range(1, n + 1):
        train_step()
        report = watch.after_step(step, {"self": module})   # a LeakReport when a window ends
        if report is not None:
            watch.warn(report)
"""

from __future__ import annotations

import builtins
import logging
import warnings
from typing import Any

from devicekit.errors import InvalidValueError, LeakWarning
from devicekit.memory.leaks import LeakDetector, LeakReport

__all__ = ["LeakWatch", "check_steps"]

log = logging.getLogger("devicekit.integrations")

# the frame that calls detector.start() and .step(): its locals are the user's names and nothing else
_START = compile("__devicekit_detector__.start()", "<devicekit leak check>", "exec")
_STEP = compile("__devicekit_detector__.step()", "<devicekit leak check>", "exec")


def check_steps(name: str, value: Any, *, allow_none: bool = True, minimum: int = 1) -> int | None:
    """``value`` as a whole number of steps >= ``minimum`` (or None), else a one-line error."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidValueError(f"{name}={value!r} must be a whole number of steps >= {minimum}"
                                + (" or None" if allow_none else ""))
    return value


class LeakWatch:
    """Run the leak finder over ``steps`` steps, first at step 1, then every ``every`` steps."""

    def __init__(self, steps: int | None = 6, every: int | None = None) -> None:
        self.steps = check_steps("leak_check_steps", steps, minimum=3)
        self.every = check_steps("leak_check_every", every)
        if self.steps is not None and self.every is not None and self.every <= self.steps:
            raise InvalidValueError(f"leak_check_every={every} must be larger than leak_check_steps={steps}: "
                                    f"a window is {steps} steps after a baseline step")
        self.reports: list[LeakReport] = []
        self._detector: LeakDetector | None = None
        self._start = 0

    def active(self, step: int) -> bool:
        """Whether ``step`` (1-based) is part of a leak-check window."""
        if self.steps is None:
            return False
        start = 1 if self.every is None or step <= self.steps + 1 else ((step - 1) // self.every) * self.every + 1
        return start <= step <= start + self.steps

    def after_step(self, step: int, holders: dict[str, Any]) -> LeakReport | None:
        """Measure after ``step``; returns the report when this step ends a window."""
        if not self.active(step):
            return None
        code = _STEP
        if self._detector is None:  # the window's baseline: started, so the memory is searched too
            self._detector, self._start, code = LeakDetector(), step, _START
        names = {name: value for name, value in holders.items() if value is not None}
        names["__devicekit_detector__"] = self._detector
        exec(code, {"__builtins__": builtins}, names)
        del names
        if step < self._start + self.steps:
            return None
        return self.finish()

    def finish(self) -> LeakReport | None:
        """End the open window now (training ended early); None when no window is open."""
        detector, self._detector = self._detector, None
        if detector is None:
            return None
        report = detector.report()
        stop = getattr(detector, "stop", None)
        if stop is not None:
            stop()
        self.reports.append(report)
        return report

    def abandon(self) -> None:
        """Drop the open window without a verdict (training failed): tracing stops now."""
        detector, self._detector = self._detector, None
        if detector is not None:
            detector.report()  # pauses line tracing
            stop = getattr(detector, "stop", None)
            if stop is not None:
                stop()

    def warn(self, report: LeakReport, *, step: int) -> list[str]:
        """Issue one :class:`LeakWarning` per leak (and the same line to the ``devicekit`` logger, at INFO)."""
        messages = []
        for leak in report.leaks:
            message = f"devicekit: leak found by step {step}: {leak}"
            # shown at the user's line that grew the holder, not at devicekit's
            # (module= is left out: an explicit None there makes no filter match, in C Python)
            warnings.warn_explicit(message, LeakWarning, leak.filename or "<devicekit leak check>",
                                   leak.lineno or 0)
            log.info("%s", message)
            messages.append(message)
        return messages
