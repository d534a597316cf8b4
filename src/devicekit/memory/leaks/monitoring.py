"""The line tracer's engine on Python 3.12+: ``sys.monitoring`` instead of ``sys.settrace``.

``sys.settrace`` calls a Python function for every function call in the process (torch's own
Python code included) and builds frame objects for them. With ``sys.monitoring`` devicekit asks
for ``PY_START`` once per code object, switches that location off for library code (returning
``DISABLE``), and turns on ``LINE``/``PY_RETURN`` only for user code. It takes a free tool id, so
it runs beside a debugger or coverage (which ``sys.settrace`` cannot), and gives everything
back on :meth:`MonitoringEngine.stop`.

Usage::

    engine = MonitoringEngine.take(on_line, on_return, is_user)   # None before 3.12 / no free id
    engine.start(frame)       # also the already running frame's code
    ...
    engine.stop()
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

__all__ = ["MonitoringEngine"]

_TOOL_IDS = (4, 3)  # ids no standard tool claims (0 debugger, 1 coverage, 2 profiler, 5 optimizer)


class MonitoringEngine:
    """Calls ``on_line(frame, filename, lineno)`` and ``on_return(frame)`` for user code only."""

    def __init__(self, tool: int, on_line: Callable[[types.FrameType, str, int], None],
                 on_return: Callable[[types.FrameType], None],
                 is_user: Callable[[types.CodeType], bool]) -> None:
        self.tool = tool
        self._on_line = on_line
        self._on_return = on_return
        self._is_user = is_user
        self._codes: set[types.CodeType] = set()
        self.active = False

    @classmethod
    def take(cls, on_line: Callable[[types.FrameType, str, int], None],
             on_return: Callable[[types.FrameType], None],
             is_user: Callable[[types.CodeType], bool]) -> MonitoringEngine | None:
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is None:
            return None
        for tool in _TOOL_IDS:
            if monitoring.get_tool(tool) is None:
                return cls(tool, on_line, on_return, is_user)
        return None

    def start(self, frame: types.FrameType | None) -> None:
        mon: Any = sys.monitoring  # type: ignore[attr-defined]
        events = mon.events
        mon.use_tool_id(self.tool, "devicekit-leaks")
        mon.register_callback(self.tool, events.PY_START, self._py_start)
        mon.register_callback(self.tool, events.LINE, self._line)
        mon.register_callback(self.tool, events.PY_RETURN, self._return)
        mon.set_events(self.tool, events.PY_START)
        if frame is not None and self._is_user(frame.f_code):
            self._follow(frame.f_code)
        self.active = True

    def stop(self) -> None:
        if not self.active:
            return
        mon: Any = sys.monitoring  # type: ignore[attr-defined]
        for code in self._codes:
            mon.set_local_events(self.tool, code, 0)
        self._codes.clear()
        mon.set_events(self.tool, 0)
        for event in (mon.events.PY_START, mon.events.LINE, mon.events.PY_RETURN):
            mon.register_callback(self.tool, event, None)
        clear = getattr(mon, "clear_tool_id", None)  # 3.13+: also forgets DISABLEd locations
        if clear is not None:
            clear(self.tool)
        mon.free_tool_id(self.tool)
        self.active = False

    def _follow(self, code: types.CodeType) -> None:
        mon: Any = sys.monitoring  # type: ignore[attr-defined]
        mon.set_local_events(self.tool, code, mon.events.LINE | mon.events.PY_RETURN)
        self._codes.add(code)

    def _py_start(self, code: types.CodeType, offset: int) -> Any:
        if not self._is_user(code):
            return sys.monitoring.DISABLE  # type: ignore[attr-defined]  # this code: never again
        if code not in self._codes:
            self._follow(code)
        return None

    def _line(self, code: types.CodeType, lineno: int) -> None:
        self._on_line(sys._getframe(1), code.co_filename, lineno)

    def _return(self, code: types.CodeType, offset: int, value: Any) -> None:
        self._on_return(sys._getframe(1))
