"""The consecutive-partition balancer against brute force."""

from __future__ import annotations

import itertools
import random

import pytest

from devicekit.errors import InvalidValueError
from devicekit.modelparallel.balance import balance_cost, fit_capacities, max_over_mean, part_costs


def brute_best(costs: list[int], parts: int) -> int:
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), parts - 1):
        bounds = [0, *cuts, len(costs)]
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


def test_balance_cost_is_optimal_on_random_rows() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        costs = [rng.randint(0, 20) for _ in range(n)]
        parts = rng.randint(1, n)
        counts = balance_cost(costs, parts)
        assert len(counts) == parts and all(c >= 1 for c in counts) and sum(counts) == n
        assert max(part_costs(costs, counts)) == brute_best(costs, parts)


def test_fit_capacities_respects_every_capacity() -> None:
    rng = random.Random(1)
    for _ in range(200):
        costs = [rng.randint(1, 10) for _ in range(rng.randint(1, 8))]
        caps = [rng.randint(0, 30) for _ in range(rng.randint(1, 4))]
        counts = fit_capacities(costs, caps)
        if counts is None:  # then no consecutive assignment fits: check by brute force
            feasible = any(
                all(sum(costs[a:b]) <= cap for (a, b), cap in zip(itertools.pairwise([0, *cuts, len(costs)]), caps, strict=True))
                for cuts in itertools.combinations_with_replacement(range(len(costs) + 1), len(caps) - 1)
            )
            assert not feasible
        else:
            assert sum(counts) == len(costs)
            assert all(c <= cap for c, cap in zip(part_costs(costs, counts), caps, strict=True))


def test_examples_and_errors() -> None:
    assert balance_cost([4, 1, 1, 1, 1, 4], 3) == [1, 4, 1]
    assert fit_capacities([3, 3], [2, 2]) is None
    assert max_over_mean([2, 2]) == 1.0 and max_over_mean([3, 1]) == 1.5
    with pytest.raises(InvalidValueError, match="into 3 parts"):
        balance_cost([1, 1], 3)
    with pytest.raises(InvalidValueError, match="non-negative"):
        balance_cost([1, -1], 1)
