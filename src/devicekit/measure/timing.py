"""Timing one operation honestly: warm-up, device synchronisation, repeats, the median.

On CUDA the operation is bracketed by CUDA events on the device's current stream (the GPU's
own clock, no host jitter); elsewhere by ``time.perf_counter`` after synchronising. Each repeat
runs the operation ``inner`` times, chosen so that one repeat lasts about ``target`` seconds,
so that microsecond kernels are not lost in launch overhead. The result is the median seconds
per call.

Usage::

    from devicekit.measure.timing import median_seconds

    seconds = median_seconds(lambda: a @ b, torch.device("cuda:0"))
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["median_seconds", "synchronize", "wall_seconds", "on_device"]


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` current (CUDA), so events and kernels go to its stream."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


def wall_seconds(fn: Callable[[], Any], device: torch.device) -> float:
    """Host wall time of one call including waiting for the device to finish."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def _one_repeat(fn: Callable[[], Any], device: torch.device, inner: int) -> float:
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) / inner


def median_seconds(fn: Callable[[], Any], device: torch.device, *, repeats: int = 5,
                   warmup: int = 2, target: float = 0.02, max_inner: int = 1000) -> float:
    """Median seconds per call of ``fn`` on ``device`` (see the module doc)."""
    with on_device(device):
        for _ in range(warmup):
            fn()
        synchronize(device)
        first = _one_repeat(fn, device, 1)
        inner = max(1, min(max_inner, math.ceil(target / max(first, 1e-7))))
        return statistics.median(_one_repeat(fn, device, inner) for _ in range(repeats))
