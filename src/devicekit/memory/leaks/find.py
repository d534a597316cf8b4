"""find_leaks: run a step function a few times and report what keeps growing.

The step function's globals, closure cells and bound ``self`` (and the caller's locals) are the
places a step can keep memory across calls; :class:`~devicekit.memory.leaks.LeakDetector`
watches them. ``step`` is called with no argument, or with the step index if it takes one.

Usage::

    import devicekit as dk

    history = []
    def train_step():
        loss = model(x).pow(2).mean()
        loss.backward()
        history.append(loss)          # keeps the graph: should be loss.item()

    report = dk.find_leaks(train_step, steps=6, warmup=2)
    print(report)                     # history: growing container, line 8, fix: x.item()
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable
from typing import Any

from devicekit.errors import InvalidValueError
from devicekit.memory.leaks.detector import LeakDetector
from devicekit.memory.leaks.discovery import code_roots, method_roots
from devicekit.memory.leaks.report import LeakReport
from devicekit.memory.roots import Root, frame_roots, function_roots

__all__ = ["find_leaks"]


def _globals_of(step: Callable[..., Any]) -> dict[str, Any]:
    """The module globals of the code behind ``step`` (function, method, partial, callable)."""
    inner: Any = step
    for _ in range(4):
        if isinstance(inner, functools.partial):
            inner = inner.func
        elif hasattr(inner, "__func__"):
            inner = inner.__func__
        elif not hasattr(inner, "__globals__") and isinstance(vars(type(inner)).get("__call__"),
                                                              types.FunctionType):
            inner = vars(type(inner))["__call__"]
        else:
            break
    found = getattr(inner, "__globals__", None)
    return found if isinstance(found, dict) else {}


def _takes_index(step: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    return len(positional) == 1


def find_leaks(step: Callable[..., Any], *, steps: int = 6, warmup: int = 2, lines: bool = True,
               cycles: bool = True, watch: dict[str, Any] | None = None) -> LeakReport:
    """Call ``step`` ``steps`` times and return the :class:`LeakReport`.

    A leak is memory that grows on (nearly) every step after the first ``warmup`` steps, so
    ``steps`` must leave at least 3 steps after warm-up.
    """
    if not callable(step):
        raise InvalidValueError(f"step={step!r} is not callable; pass the function that runs one step")
    for name, value in (("steps", steps), ("warmup", warmup)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidValueError(f"{name}={value!r} must be a whole number >= 0")
    if steps - warmup < 3:
        raise InvalidValueError(
            f"steps={steps} with warmup={warmup} leaves {steps - warmup} step(s) to judge; "
            f"use steps >= warmup + 3"
        )
    caller = sys._getframe(1)
    fixed_roots: list[Root] = function_roots(step) + frame_roots(caller, include_globals=False)
    # the globals the methods of the step's objects name (`global last_out` in `owner.grow`)
    fixed_roots += method_roots([root.get() for root in fixed_roots], {root.name for root in fixed_roots})
    detector = LeakDetector(warmup=warmup, lines=lines, cycles=cycles, watch=watch)
    detector._roots_of = lambda _frame: fixed_roots + detector._extra
    code = code_roots(_globals_of(step)) + code_roots(caller.f_locals)
    detector._code_roots_of = lambda _frame: code
    with_index = _takes_index(step)
    detector.start(None)
    try:
        for index in range(steps):
            if with_index:
                step(index)
            else:
                step()
            detector._sample(None)
    finally:
        detector.stop()
    del caller
    return detector.report()
