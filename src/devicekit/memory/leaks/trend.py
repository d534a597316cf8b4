"""Is it growing? The post-warm-up test that separates leaks from warm-up.

A series leaks when, after warm-up, it never shrinks, grows in at least three quarters of the
steps (and at least twice), and still grows on the last step. Adam's state (created on step 1)
and a cache that fills to a fixed size then stays fail this test; ``total_loss += loss`` passes.
The rate is the least-squares slope, bytes per step.

Usage::

    from devicekit.memory.leaks.trend import growth

    growth([100, 200, 300, 400])    # 100.0
    growth([100, 300, 300, 300])    # None: filled, then stayed
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["growth", "slope"]


def slope(values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` against 0, 1, 2, ..."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


def growth(values: Sequence[float], *, min_rate: float = 1.0) -> float | None:
    """Bytes per step if ``values`` (post-warm-up samples, oldest first) keep growing, else None."""
    if len(values) < 3:
        return None
    diffs = [b - a for a, b in zip(values, values[1:], strict=False)]
    if any(d < 0 for d in diffs) or diffs[-1] <= 0:
        return None
    if sum(d > 0 for d in diffs) < max(2, math.ceil(0.75 * len(diffs))):
        return None
    rate = slope(values)
    return rate if rate >= min_rate else None
