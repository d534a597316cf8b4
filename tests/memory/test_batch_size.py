"""find_batch_size: exact limit, clear failure, nothing left behind, cache, ranks agree."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

import devicekit as dk


class HiddenLimit:
    """A trial that allocates like a real step and fails above a hidden batch size."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.calls: list[int] = []
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)
        activations = torch.ones(n, 256)
        self.refs.append(weakref.ref(activations))
        if n > self.limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {n} MiB. GPU 0 has a total capacity of "
                f"80.00 GiB of which 2.00 MiB is free."
            )


@pytest.mark.parametrize(("limit", "start"), [(37, 8), (37, 100), (1, 4), (64, 64), (1000, 1)])
def test_finds_the_exact_limit_and_frees_every_trial(limit: int, start: int) -> None:
    trial = HiddenLimit(limit)
    found = dk.find_batch_size(trial, start=start)
    assert found == limit
    assert isinstance(found, int) and not found.cached
    assert [t.batch_size for t in found.trials] == trial.calls
    assert all(t.fits == (t.batch_size <= limit) for t in found.trials)
    assert len(found.trials) <= 2 * max(limit, start).bit_length() + 2
    gc.collect()
    assert all(ref() is None for ref in trial.refs)  # no tensor of any trial survives


def test_answer_pickles_with_its_trials() -> None:
    import pickle

    found = dk.find_batch_size(HiddenLimit(6), start=4)
    again = pickle.loads(pickle.dumps(found))
    assert again == 6 and again.trials == found.trials


def test_maximum_caps_the_search() -> None:
    trial = HiddenLimit(10_000)
    assert dk.find_batch_size(trial, start=16, maximum=100) == 100
    assert max(trial.calls) == 100


def test_multiple_of_tries_only_multiples() -> None:
    trial = HiddenLimit(101)
    found = dk.find_batch_size(trial, start=16, multiple_of=8)
    assert found == 96
    assert all(n % 8 == 0 for n in trial.calls)
    with pytest.raises(dk.InvalidValueError, match="start=12 is not a multiple of multiple_of=8"):
        dk.find_batch_size(trial, start=12, multiple_of=8)


def test_minimum_that_does_not_fit_is_a_clear_error() -> None:
    trial = HiddenLimit(3)
    with pytest.raises(dk.BatchSizeError) as err:
        dk.find_batch_size(trial, start=32, minimum=8)
    message = str(err.value)
    assert "batch size 8 (the minimum) does not fit" in message and "\n" not in message
    assert trial.calls == [32, 16, 8]


def test_other_errors_propagate_at_once() -> None:
    def broken(n: int) -> None:
        raise ValueError(f"shape mismatch at {n}")

    with pytest.raises(ValueError, match="shape mismatch at 32"):
        dk.find_batch_size(broken)


def test_trials_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="devicekit.memory.batch_size"):
        dk.find_batch_size(HiddenLimit(5), start=4)
    text = caplog.text
    assert "batch size 4: fits" in text and "batch size 8: out of memory" in text
    assert "largest batch size that fits: 5" in text


def test_answer_is_cached_under_a_key(tmp_path: Path) -> None:
    cache = tmp_path / "sub" / "bs.json"
    first = dk.find_batch_size(HiddenLimit(21), start=4, key="mlp", cache=cache)
    again = HiddenLimit(21)
    second = dk.find_batch_size(again, start=4, key="mlp", cache=cache)
    assert first == second == 21 and second.cached and again.calls == []
    assert json.loads(cache.read_text())["mlp"]["batch_size"] == 21
    assert [p.name for p in cache.parent.iterdir()] == ["bs.json"]  # no temp file left
    refreshed = dk.find_batch_size(HiddenLimit(9), start=4, key="mlp", cache=cache, refresh=True)
    assert refreshed == 9 and json.loads(cache.read_text())["mlp"]["batch_size"] == 9


def test_corrupt_cache_is_a_clear_error(tmp_path: Path) -> None:
    cache = tmp_path / "bs.json"
    cache.write_text("{not json")
    with pytest.raises(dk.InvalidValueError, match="is not valid JSON"):
        dk.find_batch_size(HiddenLimit(4), key="x", cache=cache)


@pytest.mark.parametrize("kwargs", [{"start": 0}, {"minimum": 4, "start": 2}, {"maximum": 2, "minimum": 4},
                                    {"start": True}])
def test_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(dk.InvalidValueError):
        dk.find_batch_size(HiddenLimit(4), **kwargs)


WORKER = """
import sys, torch, torch.distributed as dist
import devicekit as dk
rank, init = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
limit = {0: 40, 1: 27}[rank]
def trial(n):
    if n > limit:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
print("ANSWER", rank, int(dk.find_batch_size(trial, start=8)), flush=True)
dist.destroy_process_group()
"""


def two_ranks(tmp_path: Path, script: str, per_rank: tuple[list[str], list[str]] = ([], [])) -> list[str]:
    """Run ``script`` as gloo ranks 0 and 1 (bounded, killed if late); its sorted ANSWER lines."""
    env = {**os.environ, "PYTHONPATH": str(Path(dk.__file__).parents[1])}
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [subprocess.Popen([sys.executable, "-c", script, str(rank), init, *per_rank[rank]],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=60)[0])
    except subprocess.TimeoutExpired:
        pass  # a hang: the assertion on the answers shows what each rank printed
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    answers = sorted(line for out in outputs for line in out.splitlines() if line.startswith("ANSWER"))
    return answers or outputs


@pytest.mark.slow
def test_ranks_agree_on_the_smallest(tmp_path: Path) -> None:
    assert two_ranks(tmp_path, WORKER) == ["ANSWER 0 27", "ANSWER 1 27"]


def test_cached_answer_outside_the_bounds_is_searched_again(tmp_path: Path) -> None:
    cache = tmp_path / "bs.json"
    assert dk.find_batch_size(HiddenLimit(21), start=4, key="mlp", cache=cache) == 21
    eights = dk.find_batch_size(HiddenLimit(21), start=8, multiple_of=8, key="mlp", cache=cache)
    assert eights == 16 and not eights.cached  # 21 is no multiple of 8
    bounded = dk.find_batch_size(HiddenLimit(21), start=4, maximum=12, key="mlp", cache=cache)
    assert bounded == 12 and not bounded.cached  # never above the caller's maximum


def test_cached_answer_from_another_gpu_is_not_used(tmp_path: Path) -> None:
    cache = tmp_path / "bs.json"
    other = "NVIDIA GeForce GTX 480"  # no machine running these tests has one
    cache.write_text(json.dumps({"mlp": {"batch_size": 512, "device": other}}))
    found = dk.find_batch_size(HiddenLimit(21), start=4, key="mlp", cache=cache)
    assert found == 21 and not found.cached  # cached on another GPU model: search here


CACHE_WORKER = """
import sys, torch, torch.distributed as dist
import devicekit as dk
rank, init, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
def trial(n):
    if n > 27:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
found = dk.find_batch_size(trial, start=8, key="net", cache=cache)
print("ANSWER", rank, int(found), found.cached, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_rank_without_the_cache_does_not_hang_the_others(tmp_path: Path) -> None:
    caches = [tmp_path / "node0.json", tmp_path / "node1.json"]  # node-local caches
    caches[0].write_text(json.dumps({"net": {"batch_size": 24}}))  # only rank 0's node has it
    answers = two_ranks(tmp_path, CACHE_WORKER, ([str(caches[0])], [str(caches[1])]))
    assert answers == ["ANSWER 0 27 False", "ANSWER 1 27 False"]
