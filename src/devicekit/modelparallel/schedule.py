"""The GPipe clock: which (micro-batch, stage) pairs run at each tick.

With ``m`` micro-batches and ``n`` stages there are ``m + n - 1`` ticks; at tick ``k`` stage
``j`` works on micro-batch ``k - j``. The pipeline fills for ``n - 1`` ticks and drains for
``n - 1`` ticks, so with equal stages each one idles a fraction ``(n - 1) / (m + n - 1)`` of
the time (the "bubble"): more micro-batches, smaller bubble. :class:`~devicekit.modelparallel.pipeline.Pipeline`
keeps this order without a barrier per tick: micro-batch ``i`` enters a stage once micro-batch
``i - 1`` has left it (:mod:`devicekit.modelparallel.microbatch_threads`).

Usage::

    from devicekit.modelparallel.schedule import clock_cycles, bubble_fraction

    list(clock_cycles(3, 2))   # [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    bubble_fraction(8, 2)      # 1/9
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["clock_cycles", "bubble_fraction"]


def clock_cycles(microbatches: int, stages: int) -> Iterator[list[tuple[int, int]]]:
    """Yield, per tick, the (micro-batch, stage) pairs that can run at the same time."""
    for k in range(microbatches + stages - 1):
        yield [(k - j, j) for j in range(max(0, k - microbatches + 1), min(k + 1, stages))]


def bubble_fraction(microbatches: int, stages: int) -> float:
    """The idle fraction GPipe's schedule predicts for equal stages: (n - 1) / (m + n - 1)."""
    return (stages - 1) / (microbatches + stages - 1)
