"""Find hidden host synchronisations (``.item()``, ``.cpu()``, ``print(tensor)``) in a hot loop.

On CUDA, ``sync_guard()`` turns on torch's sync debug mode (``torch.cuda.set_sync_debug_mode``)
for the block: every operation that makes the host wait for the GPU is caught, and the report
lists each place in your code that did it, with a count. ``mode="error"`` makes the first one
raise instead (the report still records it). The previous debug mode is restored on exit.

On a CPU-only run there is nothing to find: CPU operations run on the host as they are called,
so there is no device queue to wait for. The body still runs, and the report says exactly that
rather than claiming the loop is clean.

Usage::

    import devicekit as dk

    with dk.sync_guard() as report:
        for x, y in loader:
            loss = step(x, y)
            total += loss.item()        # caught on CUDA
    print(report)                        # "2 host syncs caught ... train.py:12  total += loss.item()  x100"
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch

from devicekit.errors import InvalidValueError
from devicekit.placement.devices import DeviceLike, as_device

__all__ = ["sync_guard", "SyncReport", "HostSync", "SYNC_MESSAGE"]

#: What torch's sync debug mode says (c10/cuda/CUDAFunctions.cpp).
SYNC_MESSAGE = "called a synchronizing CUDA operation"
_MODES = ("warn", "error")
# Frames to look through when naming the line that synced: torch's own Python code, the
# warnings machinery, and devicekit.placement (a sync inside e.g. RunningMean.value is the
# caller's read).
_SKIP_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)
_SKIP_FILES = frozenset({warnings.__file__, contextlib.__file__})


def _skipped(filename: str) -> bool:
    return filename in _SKIP_FILES or filename.startswith(_SKIP_DIRS)


@dataclass
class HostSync:
    """One place in the code that synchronised with the device, and how often it did."""

    filename: str
    lineno: int
    line: str
    count: int = 1

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno}  {self.line}  x{self.count}"


@dataclass
class SyncReport:
    """What a ``sync_guard`` block found. ``checked`` is False where there was nothing to check."""

    mode: str
    device: torch.device
    checked: bool
    explanation: str = ""
    syncs: list[HostSync] = field(default_factory=list)
    raised: bool = False

    @property
    def count(self) -> int:
        """Host syncs caught (0 also when ``checked`` is False: see ``explanation``)."""
        return sum(s.count for s in self.syncs)

    def record(self, filename: str, lineno: int) -> None:
        for sync in self.syncs:
            if sync.filename == filename and sync.lineno == lineno:
                sync.count += 1
                return
        line = linecache.getline(filename, lineno).strip() or "<source not available>"
        self.syncs.append(HostSync(filename, lineno, line))

    def __str__(self) -> str:
        if not self.checked:
            return f"host syncs not checked on {self.device}: {self.explanation}"
        if not self.syncs:
            return f"no host syncs caught on {self.device} (torch sync debug mode, {self.mode})"
        head = f"{self.count} host sync(s) caught on {self.device} at {len(self.syncs)} place(s):"
        return "\n".join([head, *(f"  {s}" for s in self.syncs)])


def _caller_frame() -> FrameType | None:
    """The innermost frame outside torch, the warnings machinery and this module."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and _skipped(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


@contextmanager
def _collect(report: SyncReport) -> Iterator[None]:
    """Record every sync warning raised inside the block; other warnings pass through."""
    original = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every sync, not once per location

        def show(message: Any, category: Any, filename: str, lineno: int, *args: Any, **kw: Any) -> None:
            if SYNC_MESSAGE not in str(message):
                original(message, category, filename, lineno, *args, **kw)
                return
            frame = _caller_frame()
            if frame is None:
                report.record(filename, lineno)
            else:
                report.record(frame.f_code.co_filename, frame.f_lineno)

        warnings.showwarning = show
        try:
            yield
        except RuntimeError as err:
            if SYNC_MESSAGE in str(err):  # mode="error": record where, then let it propagate
                report.raised = True
                tb = err.__traceback__
                place = None
                while tb is not None:
                    if not _skipped(tb.tb_frame.f_code.co_filename):
                        place = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
                    tb = tb.tb_next
                if place is not None:
                    report.record(*place)
            raise


def _cpu_explanation(device: torch.device) -> str:
    return (
        f"{device.type} operations run on the host as they are called, so .item(), .cpu() and "
        "print(tensor) never wait for a device queue; there are no host syncs to find. Run the "
        "loop on a CUDA device to check it"
    )


@contextmanager
def sync_guard(mode: str = "warn", device: DeviceLike | None = None) -> Iterator[SyncReport]:
    """Catch host synchronisations in the block; yields the :class:`SyncReport` it fills.

    ``mode="warn"`` records every sync and lets the loop run; ``mode="error"`` raises at the
    first one. ``device`` defaults to the current CUDA device, or the CPU without CUDA.
    """
    if mode not in _MODES:
        raise InvalidValueError(f"sync_guard mode {mode!r} is not one of {', '.join(_MODES)}")
    if device is None:
        target = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    else:
        target = as_device(device)
    if target.type != "cuda":
        yield SyncReport(mode, target, checked=False, explanation=_cpu_explanation(target))
        return
    report = SyncReport(mode, target, checked=True)
    previous = torch.cuda.get_sync_debug_mode()
    with _collect(report):
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield report
        finally:
            torch.cuda.set_sync_debug_mode(previous)
