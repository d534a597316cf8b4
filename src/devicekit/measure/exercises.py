"""The D2L chapter's exercises, measured: launch latency, logging with ``.item()`` per step vs
:class:`devicekit.MetricLog`, and N GPUs working at once vs one after another.

Usage::

    from devicekit.measure.exercises import launch_latency_us, logging_seconds, scaling

    launch_latency_us(torch.device("cuda:0"))          # e.g. 6.1 (microseconds per tiny op)
    logging_seconds(torch.device("cuda:0"), steps=1000)  # {"item_per_step": ..., "speedup": ...}
    scaling([torch.device("cuda:0"), torch.device("cuda:1")])  # {"speedup": 1.97, ...}
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from devicekit.measure.timing import on_device, synchronize

__all__ = ["launch_latency_us", "logging_seconds", "median_round", "scaling", "NOISY_SPREAD"]


def launch_latency_us(device: torch.device, ops: int = 1000) -> float:
    """Microseconds per tiny op (a one-element in-place add), queued back to back; on the CPU
    the dispatch overhead of an op."""
    with on_device(device):
        x = torch.zeros(1, device=device)
        for _ in range(50):
            x.add_(1)
        rounds = []
        for _ in range(3):
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(ops):
                x.add_(1)
            synchronize(device)
            rounds.append((time.perf_counter() - t0) / ops)
    return statistics.median(rounds) * 1e6


#: a speed-up whose repeats spread more than this (max / min) is reported as noisy
NOISY_SPREAD = 1.5


def logging_seconds(device: torch.device, steps: int = 1000, n: int = 100,
                    rounds: int = 5, budget: float | None = None) -> dict[str, float]:
    """D2L exercise 3: ``steps`` products of ``n x n`` matrices, logging the Frobenius norm of
    each with ``.item()`` per step vs in a :class:`devicekit.MetricLog` read once at the end.

    The two run alternately ``rounds`` times (so a burst of load from elsewhere hits both), each
    round giving one speed-up; the result is :func:`median_round` of them. ``budget``: seconds
    after which no new round starts (at least one runs), so a busy machine cannot stretch it.
    """
    from devicekit.placement.metric_log import MetricLog

    with on_device(device):
        a = torch.randn(n, n, device=device) / n**0.5

        def per_step(count: int = steps) -> list[float]:
            return [torch.linalg.matrix_norm(a @ a).item() for _ in range(count)]

        def on_device_log(count: int = steps) -> list[float]:
            log = MetricLog()
            for _ in range(count):
                log.append(norm=torch.linalg.matrix_norm(a @ a))
            return dict(log)["norm"]

        warm = min(steps, 20)
        per_step(warm), on_device_log(warm)  # warm-up (kernels, allocator)
        times: dict[str, list[float]] = {"item_per_step": [], "metric_log": []}
        start = time.perf_counter()
        for _ in range(max(rounds, 1)):
            if times["metric_log"] and budget is not None and time.perf_counter() - start > budget:
                break
            for name, fn in (("item_per_step", per_step), ("metric_log", on_device_log)):
                synchronize(device)
                t0 = time.perf_counter()
                fn()
                synchronize(device)
                times[name].append(time.perf_counter() - t0)
    return median_round(times["item_per_step"], times["metric_log"])


def median_round(item_per_step: Sequence[float], metric_log: Sequence[float]) -> dict[str, float]:
    """The round (one ``.item()`` run and the MetricLog run after it) whose speed-up is the
    median (the lower one of an even count): its two times, ``speedup`` = their ratio, so the
    times shown and the verdict always agree (the medians of each side alone need not: a burst
    of load can make them say the opposite of most rounds). ``spread``: max / min speed-up."""
    ratios = [i / m for i, m in zip(item_per_step, metric_log, strict=True)]
    order = sorted(range(len(ratios)), key=ratios.__getitem__)
    middle = order[(len(order) - 1) // 2]
    return {"item_per_step": item_per_step[middle], "metric_log": metric_log[middle],
            "speedup": ratios[middle], "spread": max(ratios) / min(ratios),
            "rounds": float(len(ratios)), "median_round": float(middle)}


def _task(device: torch.device, n: int, repeats: int) -> None:
    a = torch.randn(n, n, device=device, dtype=_dtype(device))
    for _ in range(repeats):
        a = torch.mm(a, a) / n  # keep values finite; one product depends on the last


def _dtype(device: torch.device) -> torch.dtype:
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16


def scaling(devices: Sequence[torch.device], n: int = 4096, repeats: int = 20) -> dict[str, float]:
    """D2L exercise 4: one matmul task per GPU, all at once, vs the same tasks one after another
    on the first GPU. ``speedup`` is sequential / concurrent time (ideal: ``len(devices)``)."""
    first = devices[0]
    for dev in devices:  # warm-up every device's kernels and allocator
        with on_device(dev):
            _task(dev, n, 2)
    for dev in devices:
        synchronize(dev)
    t0 = time.perf_counter()
    with on_device(first):
        for _ in devices:
            _task(first, n, repeats)
    synchronize(first)
    sequential = time.perf_counter() - t0
    t0 = time.perf_counter()
    for dev in devices:  # queued asynchronously: the GPUs run at the same time
        with on_device(dev):
            _task(dev, n, repeats)
    for dev in devices:
        synchronize(dev)
    concurrent = time.perf_counter() - t0
    return {"sequential_seconds": sequential, "concurrent_seconds": concurrent,
            "speedup": sequential / concurrent, "ideal": float(len(devices))}
