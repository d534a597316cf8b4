"""devicekit.memory: see what uses memory, find what leaks, explain an OOM, size the batch.

Usage::

    import devicekit as dk

    dk.memory.report()                      # allocated / reserved / peak / free per device
    print(dk.memory.census(top=10))         # biggest tensors by name and by shape
    report = dk.find_leaks(train_step)      # names the variable that keeps growing
    with dk.oom_guard():                    # explains an out-of-memory error in plain words
        train()
    bs = dk.find_batch_size(lambda n: train_step(batch_size=n), start=32)

May import: ``units``, ``errors``, ``hardware``, ``sharing``, ``placement`` (and torch). The estimate before
running (``estimate``, ``fake_step``, ``step``) lives here; the strategy advisor that combines it
with the parallel wings is :mod:`devicekit.strategy`, one floor up.

Submodules: ``usage``, ``usage_table``, ``census``, ``release``, ``leaks``, ``oom``, ``batch_size``,
``timeline``, ``utilization``. The names below are imported on first use, so importing
one submodule (e.g. ``utilization`` for ``dk.show_utilization(compact=True)``) does not import
torch or the rest of the wing. Tests: ``tests/memory/`` (``leaks/`` in ``tests/memory/leaks/``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

#: public name -> the submodule that defines it (imported on first use)
_EXPORTS = {
    "BatchSize": "batch_size", "find_batch_size": "batch_size",
    "Census": "census", "CensusEntry": "census", "CensusGroup": "census", "census": "census",
    "Leak": "leaks", "LeakDetector": "leaks", "LeakReport": "leaks", "find_leaks": "leaks",
    "install_oom_handler": "oom", "oom_guard": "oom",
    "Released": "release", "empty_cache": "release", "release": "release",
    "report": "usage_table",
    "MemoryTimeline": "timeline", "TimelineSample": "timeline",
    "DeviceMemory": "usage", "usage": "usage",
    "show_utilization": "utilization",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:  # a submodule (dk.memory.leaks), imported on first use like the names
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


class _Package(types.ModuleType):
    """Keeps ``usage``, ``census`` and ``release`` the functions, not the same-named submodules.

    Importing a submodule sets it as an attribute of its package; with lazy names that would
    replace ``dk.memory.usage()`` (the function) by ``devicekit.memory.usage`` (the module).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
