"""Interleaved timing for the benchmarks: methods take turns, so load from other processes hits
all of them alike (the machines these run on are shared).

Usage (from a script in benchmarks/, which puts this folder on ``sys.path``)::

    from timing import interleaved

    times = interleaved({"anchor": run_anchor, "devicekit": run_ours}, rounds=15)
    best = {name: min(t) for name, t in times.items()}
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["interleaved"]


def interleaved(methods: dict[str, Callable[[], object]], rounds: int,
                warmup: int = 1) -> dict[str, list[float]]:
    """Every round's seconds per method, after ``warmup`` untimed calls of each."""
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times
