"""The gloo rank runner behind check_equivalence: failures come back fast, nothing is left."""

from __future__ import annotations

import multiprocessing
import time

import pytest

import devicekit as dk
from devicekit.parallel.gloo_ranks import run_gloo_ranks
from tests.parallel import ddp_workloads as work


def test_a_failing_rank_stops_the_others_and_carries_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(dk.RankFailedError, match="rank 1 raised: ValueError: bad shard") as caught:
        run_gloo_ranks(work.rank_one_fails, world_size=2, timeout=60)
    assert time.monotonic() - start < 30          # not the 60 s timeout: rank 0 was stopped
    assert caught.value.rank == 1
    assert "rank_one_fails" in caught.value.traceback_text
    assert multiprocessing.active_children() == []


def test_unpicklable_function_is_a_one_line_error() -> None:
    with pytest.raises(dk.InvalidValueError, match="module-level function"):
        run_gloo_ranks(lambda: 1, world_size=2)
    with pytest.raises(dk.InvalidValueError, match="world_size=0"):
        run_gloo_ranks(work.rank_one_fails, world_size=0)
