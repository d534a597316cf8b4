"""Cut a row of layer costs into consecutive parts so the largest part is as small as possible.

Two questions, both answered exactly (binary search on the largest part's cost, with a greedy
check that is optimal for consecutive parts):

* :func:`balance_cost`: ``parts`` parts, each non-empty, minimise the largest (torchgpipe's
  ``balance_by_size``/``balance_by_time`` question);
* :func:`fit_capacities`: ordered devices with their own capacities (memory budgets), every part
  within its device's capacity, parts may be empty, minimise the largest.

Usage::

    from devicekit.modelparallel.balance import balance_cost, fit_capacities

    balance_cost([4, 1, 1, 1, 1, 4], 3)            # [1, 4, 1]: parts cost 4, 4, 4
    fit_capacities([3, 3, 3, 3], [5, 100, 100])    # [1, 2, 1]: largest part 6, first within 5
    fit_capacities([3, 3], [2, 2])                 # None: a layer fits nowhere
"""

from __future__ import annotations

from collections.abc import Sequence

from devicekit.errors import InvalidValueError

__all__ = ["balance_cost", "fit_capacities", "part_costs", "max_over_mean"]

_ITERATIONS = 100


def part_costs(costs: Sequence[float], counts: Sequence[int]) -> list[float]:
    """The summed cost of each part given layer counts per part."""
    out, start = [], 0
    for count in counts:
        out.append(float(sum(costs[start:start + count])))
        start += count
    return out


def max_over_mean(values: Sequence[float]) -> float:
    """Largest part over the mean part (1.0 is perfect balance); 1.0 when all are zero."""
    values = list(values)
    if not values:
        return 1.0
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def _greedy(costs: Sequence[float], limits: Sequence[float], nonempty: bool) -> list[int] | None:
    """Fill parts left to right while within each limit; None when layers remain."""
    counts: list[int] = []
    i, n = 0, len(costs)
    for d, limit in enumerate(limits):
        remaining_parts = len(limits) - d - 1
        total, count = 0.0, 0
        while i < n and total + costs[i] <= limit:
            if nonempty and count > 0 and n - i <= remaining_parts:
                break  # leave one layer for each part still to come
            total += costs[i]
            count += 1
            i += 1
        if nonempty and count == 0:
            return None
        counts.append(count)
    return counts if i == n else None


def _search(costs: Sequence[float], limits: Sequence[float], nonempty: bool) -> list[int] | None:
    """Smallest threshold T such that the greedy fill under min(T, limit) places every layer."""
    def attempt(threshold: float) -> list[int] | None:
        return _greedy(costs, [min(threshold, limit) for limit in limits], nonempty)

    high = float(sum(costs))
    best = attempt(high * (1 + 1e-12) + 1e-12)
    if best is None:
        return None
    low = max(costs, default=0.0)
    if (found := attempt(low)) is not None:
        return found
    for _ in range(_ITERATIONS):  # invariant: attempt(low) fails, attempt(high) succeeds
        mid = (low + high) / 2
        found = attempt(mid)
        if found is None:
            low = mid
        else:
            high, best = mid, found
        if high - low <= 1e-9 * max(high, 1e-30):
            break
    return best


def _check(costs: Sequence[float]) -> None:
    if any(c < 0 for c in costs):
        raise InvalidValueError(f"layer costs {list(costs)!r} must be non-negative")


def balance_cost(costs: Sequence[float], parts: int) -> list[int]:
    """Layer counts for ``parts`` non-empty consecutive parts minimising the largest part's cost."""
    _check(costs)
    if parts < 1:
        raise InvalidValueError(f"parts {parts!r} must be at least 1")
    if parts > len(costs):
        raise InvalidValueError(
            f"cannot cut {len(costs)} layer(s) into {parts} parts; use at most {len(costs)} devices"
        )
    found = _search([float(c) for c in costs], [float("inf")] * parts, nonempty=True)
    assert found is not None  # always feasible with enough layers
    return found


def fit_capacities(costs: Sequence[float], capacities: Sequence[float]) -> list[int] | None:
    """Layer counts per device (0 allowed) within each capacity, largest part minimal; None if impossible."""
    _check(costs)
    return _search([float(c) for c in costs], [float(c) for c in capacities], nonempty=False)
