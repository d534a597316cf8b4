"""Line attribution: which source line extended a holder, found by tracing user code only.

While some holders are suspected (they grew on the last step), :class:`LineTracer` follows
only frames of user code (not the stdlib, site-packages or devicekit): on Python 3.12+ through
``sys.monitoring`` (:mod:`~devicekit.memory.leaks.monitoring`: library code is switched off
after its first call), before that through ``sys.settrace`` (other calls get no local tracer
and cost one cheap check). At every traced line
it compares a fingerprint of each suspect (identity, length, tensor version: O(1), no walking)
with the last one; a change that extends the holder is charged to the line that ran just before.
So ``total_loss += loss`` (an in-place add bumps the tensor's version), ``history.append(x)``
and ``self.cache[k] = v`` inside ``forward`` are each found at their own line. A chain of
tensors linked through an attribute (``out.prev = last_out; last_out = out``) is charged to the
line that links it: the first line after which a local tensor holds the chain's head in an
attribute (the head's replacement on the next line only moves the name). Another tracer
(a debugger, coverage) is never replaced: before 3.12 attribution is then off and the report
says so; from 3.12 both run side by side.

Usage::

    tracer = LineTracer()
    tracer.watch({"total_loss": holder})
    tracer.start(frame)           # frame: the loop's frame, already running (None: new calls only)
    ...                           # run a step
    tracer.stop()
    tracer.hits                   # {"total_loss": ("train.py", 42)}
"""

from __future__ import annotations

import collections
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from devicekit.memory.leaks.holders import Holder
from devicekit.memory.leaks.monitoring import MonitoringEngine
from devicekit.memory.leaks.reach import LRU_TYPE
from devicekit.memory.paths import CONTAINERS
from devicekit.memory.roots import MISSING, is_user_file

__all__ = ["LineTracer", "fingerprint", "extends"]

_Print = tuple[int, int, int] | None


def fingerprint(value: Any) -> _Print:
    """Cheap identity of a holder's state: (id, version or length, id of a list's last item)."""
    if value is MISSING:
        return None
    if isinstance(value, torch.Tensor):
        return (id(value), value._version, 0)
    if isinstance(value, (list, collections.deque)):  # `head[0] = out` replaces, at the same length
        return (id(value), len(value), id(value[-1]) if value else 0)
    if isinstance(value, CONTAINERS):
        return (id(value), len(value), 0)
    if isinstance(value, LRU_TYPE):
        return (id(value), value.cache_info().currsize, 0)
    return (id(value), 0, 0)


def extends(old: _Print, new: _Print) -> bool:
    """Did the holder get longer, get its last item replaced, or get replaced itself (``x = x + y``,
    ``x += y``)?"""
    if new is None:
        return False
    if old is None:
        return True
    if old[0] == new[0]:
        return new[1] > old[1] or (new[1] == old[1] and new[2] != old[2])
    return True


class LineTracer:
    """Charges holder changes to source lines; see the module docstring."""

    def __init__(self) -> None:
        self.hits: dict[str, tuple[str, int]] = {}
        self.active = False
        self.blocked: str | None = None
        self._watch: dict[str, Holder] = {}
        self._types: tuple[type, ...] = ()
        self._seen: set[int] = set()
        self._prints: dict[str, _Print] = {}
        self._prev: tuple[str, int] | None = None
        self._chains: set[str] = set()  # watched holders whose head tensor links to the last one
        self._links: dict[str, tuple[int, tuple[str, int]]] = {}  # path -> (id of linking tensor, line)
        self._user_code: dict[types.CodeType, bool] = {}
        self._frame: types.FrameType | None = None
        self._previous_trace: Callable[..., Any] | None = None
        self._engine: MonitoringEngine | None = None

    def watch(self, holders: dict[str, Holder]) -> None:
        """Follow these holders from now on (fingerprints taken now)."""
        self._watch = dict(holders)
        self._prints = {path: fingerprint(h.get()) for path, h in self._watch.items()}
        self._chains = {path for path, h in self._watch.items() if _links_back(_head(h.get())) is not None}
        self._links.clear()
        self._prev = None

    def watch_types(self, types_: tuple[type, ...]) -> None:
        """Charge the creation of new instances of ``types_`` (cycle holders) to a line too:
        a new instance first seen in a traced frame's locals (``self`` in its ``__init__``)
        was made by the line that ran just before; hits are keyed ``type:<name>``."""
        self._types = tuple(types_)
        self._seen.clear()

    def start(self, frame: types.FrameType | None = None) -> bool:
        """Trace user code from now; ``frame``: an already running frame to trace too."""
        if self.active:
            return True
        engine = MonitoringEngine.take(self._on_line, self._on_return, self._is_user)
        if engine is not None:  # Python 3.12+: cheaper, and coexists with debuggers and coverage
            self._engine = engine
            engine.start(frame)
            self.active = True
            return True
        current = sys.gettrace()
        if current is not None:
            self.blocked = "line attribution off: another tracer (debugger or coverage) is active"
            return False
        self._previous_trace = current
        sys.settrace(self._global)
        if frame is not None and self._is_user(frame.f_code):
            frame.f_trace = self._local
            frame.f_trace_lines = True
            self._frame = frame
        self.active = True
        return True

    def stop(self) -> None:
        if not self.active:
            return
        self.active = False
        if self._engine is not None:
            self._engine.stop()
            self._engine = None
            return
        sys.settrace(self._previous_trace)
        if self._frame is not None:
            self._frame.f_trace = None
            self._frame = None

    def check(self) -> None:
        """Compare fingerprints now; charge changes to the last traced line (also called at step)."""
        prev = self._prev
        for path, holder in self._watch.items():
            new = fingerprint(holder.get())
            old = self._prints.get(path)
            if new != old:
                self._prints[path] = new
                if prev is not None and extends(old, new):
                    link = self._links.pop(path, None)
                    self.hits[path] = link[1] if link is not None else prev

    def _spot_link(self, frame: types.FrameType) -> None:
        """Note the line that made a local tensor hold a chain's head in an attribute."""
        if self._prev is None:
            return
        for path in self._chains:
            head = _head(self._watch[path].get())
            if head is None:
                continue
            for value in frame.f_locals.values():
                if value is not head and _links_to(value, head):
                    if path not in self._links or self._links[path][0] != id(value):
                        self._links[path] = (id(value), self._prev)
                    break

    def _on_line(self, frame: types.FrameType, filename: str, lineno: int) -> None:
        if self._chains:
            self._spot_link(frame)
        self.check()
        if self._types:
            self._spot_new(frame)
        self._prev = (filename, lineno)

    def _spot_new(self, frame: types.FrameType) -> None:
        for value in frame.f_locals.values():
            if type(value) in self._types and id(value) not in self._seen:
                self._seen.add(id(value))
                if self._prev is not None:
                    self.hits[f"type:{type(value).__name__}"] = self._prev

    def _is_user(self, code: types.CodeType) -> bool:
        found = self._user_code.get(code)
        if found is None:
            found = self._user_code[code] = is_user_file(code.co_filename)
        return found

    def _global(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "call" and self._is_user(frame.f_code):
            return self._local
        return None

    def _local(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self._on_line(frame, frame.f_code.co_filename, frame.f_lineno)
        elif event == "return":
            self._on_return(frame)
        return self._local

    def _on_return(self, frame: types.FrameType) -> None:
        """Check, then charge what happens next to the caller's line: ``history.append(f())``
        stores after ``f`` returned, on the caller's line, not on ``f``'s last one."""
        self.check()
        back = frame.f_back
        if back is not None and self._is_user(back.f_code):
            self._prev = (back.f_code.co_filename, back.f_lineno)


def _head(value: Any) -> torch.Tensor | None:
    """The tensor at a holder's head: the holder itself, or a list's last item."""
    if isinstance(value, (list, collections.deque)) and value:
        value = value[-1]
    return value if isinstance(value, torch.Tensor) else None


def _links_back(value: Any) -> torch.Tensor | None:
    """The tensor a tensor keeps in one of its attributes (``out.prev``), or None."""
    if not isinstance(value, torch.Tensor):
        return None
    attributes = getattr(value, "__dict__", None)
    return next((v for v in (attributes or {}).values() if isinstance(v, torch.Tensor)), None)


def _links_to(value: Any, head: torch.Tensor) -> bool:
    """Does a tensor keep ``head`` in one of its attributes?"""
    if not isinstance(value, torch.Tensor):
        return False
    return any(v is head for v in (getattr(value, "__dict__", None) or {}).values())
