"""dk.Pipeline: GPipe micro-batches over worker threads give the unsplit model's results."""

from __future__ import annotations

import copy
import threading
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit.modelparallel.schedule import bubble_fraction, clock_cycles
from tests.modelparallel.modelpar_models import (
    MODELS,
    assert_same_grads,
    cnn_bn,
    loss_of,
    reference_run,
    sample_for,
)


@pytest.mark.parametrize("name", ["mlp", "transformer"])
@pytest.mark.parametrize("parts, chunks, checkpoint", [
    (2, 1, "never"), (2, 4, "never"), (2, 4, "except_last"), (3, 2, "always"), (4, 8, "except_last"),
])
def test_pipeline_matches_unsplit_model(name: str, parts: int, chunks: int, checkpoint: str) -> None:
    x = sample_for(name)
    ref, want = reference_run(MODELS[name], x)
    pipe = dk.Pipeline(MODELS[name](), ["cpu"] * parts, chunks=chunks, checkpoint=checkpoint, sample=x)
    out = pipe(x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    loss_of(out).backward()
    assert_same_grads(pipe.module, ref)
    assert pipe.last_run is not None and pipe.last_run.microbatches == min(chunks, len(x))


def test_batchnorm_pipeline_with_one_chunk_is_exact() -> None:
    x = sample_for("cnn_bn")
    ref, want = reference_run(cnn_bn, x)
    pipe = dk.Pipeline(cnn_bn(), ["cpu", "cpu"], chunks=1, sample=x)
    out = pipe(x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    loss_of(out).backward()
    assert_same_grads(pipe.module, ref)
    for got, expected in zip(pipe.module.buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_batchnorm_statistics_match_a_non_pipelined_run(checkpoint: str) -> None:
    x = sample_for("cnn_bn", batch=16)
    # each micro-batch is normalised with its own statistics (as GPipe does) ...
    ref, want = reference_run(cnn_bn, x, chunks=4)
    pipe = dk.Pipeline(cnn_bn(), ["cpu", "cpu", "cpu"], chunks=4, checkpoint=checkpoint)
    out = pipe(x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    loss_of(out).backward()
    assert_same_grads(pipe.module, ref)
    # ... but running statistics are updated once per mini-batch, as the unsplit model's are
    full = cnn_bn()
    full(x)
    bn, full_bn = pipe.module[1], full[1]
    torch.testing.assert_close(bn.running_mean, full_bn.running_mean)
    torch.testing.assert_close(bn.running_var, full_bn.running_var)
    assert int(bn.num_batches_tracked) == 1 and int(pipe.module[4].num_batches_tracked) == 1
    # in eval mode the pipeline and the unsplit model agree exactly
    pipe.eval()
    full.load_state_dict(pipe.module.state_dict())
    full.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), full(x), atol=1e-5, rtol=1e-4)


def test_checkpointing_recomputes_on_backward() -> None:
    calls: list[int] = []

    class Counting(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            return x * 2

    model = nn.Sequential(Counting(), nn.Linear(4, 4), nn.Linear(4, 4))  # the Linear needs its input
    x = torch.randn(8, 4)
    for mode, expected in [("never", 4), ("except_last", 7), ("always", 8)]:
        calls.clear()
        pipe = dk.Pipeline(model, ["cpu", "cpu"], chunks=4, checkpoint=mode, balance=[2, 1])
        pipe(x).sum().backward()
        assert len(calls) == expected, mode
        calls.clear()
        with torch.no_grad():
            pipe(x)
        assert len(calls) == 4  # no checkpointing without grad


class RecordingDropout(nn.Dropout):
    """Dropout that records every mask it draws (first run and recomputation alike)."""

    def __init__(self) -> None:
        super().__init__(0.5)
        self.masks: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        mask = (torch.rand_like(x) > self.p).to(x.dtype)
        self.masks.append(mask)
        return x * mask / (1 - self.p)


def test_checkpointed_dropout_replays_the_forward_masks() -> None:
    """Recomputation must draw the masks the forward drew; stage threads sharing the CPU
    generator used to interleave their draws, so backward replayed other masks."""
    torch.manual_seed(0)
    drops = [RecordingDropout(), RecordingDropout()]
    model = nn.Sequential(nn.Linear(64, 64), drops[0], nn.Linear(64, 64), drops[1], nn.Linear(64, 1))
    before = set(microbatch_threads())
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=8, balance=[2, 3], checkpoint="always") as pipe:
        for _ in range(4):
            for drop in drops:
                drop.masks.clear()
            pipe(torch.randn(64, 64)).sum().backward()
            for drop in drops:
                first, again = drop.masks[:8], drop.masks[8:]
                assert len(again) == 8
                assert all(any(torch.equal(m, f) for f in first) for m in again)
        pipe.eval()
        pipe(torch.randn(64, 64))  # no dropout in eval: the micro-batch threads run again
        assert len(set(microbatch_threads()) - before) == 8


def microbatch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("devicekit-microbatch-")]


def test_micro_batches_run_in_their_own_threads_and_errors_come_back() -> None:
    seen: set[tuple[int, str]] = set()

    class Where(nn.Module):
        def __init__(self, stage: int) -> None:
            super().__init__()
            self.stage = stage

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.add((self.stage, threading.current_thread().name))
            return x

    before = threading.active_count()
    pipe = dk.Pipeline(nn.Sequential(Where(0), Where(1)), ["cpu", "cpu"], chunks=2, balance=[1, 1])
    with torch.no_grad():
        pipe(torch.randn(4, 2))
    assert seen == {(stage, f"devicekit-microbatch-{i}") for stage in (0, 1) for i in (0, 1)}
    pipe.close()

    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom in stage 1")

    pipe = dk.Pipeline(nn.Sequential(nn.Linear(2, 2), Broken()), ["cpu", "cpu"], chunks=2, balance=[1, 1])
    with pytest.raises(RuntimeError, match="boom in stage 1"):
        pipe(torch.randn(4, 2))
    assert threading.active_count() == before


def test_autocast_reaches_the_stage_threads() -> None:
    pipe = dk.Pipeline(MODELS["mlp"](), ["cpu", "cpu"], chunks=2, checkpoint="never")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert pipe(sample_for("mlp")).dtype == torch.bfloat16
    assert pipe(sample_for("mlp")).dtype == torch.float32
    with torch.inference_mode():
        assert pipe(sample_for("mlp")).is_inference()
    assert pipe(sample_for("mlp")).requires_grad


def test_tuple_inputs_and_small_batches() -> None:
    class Add(nn.Module):
        def forward(self, xy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return xy[0] + xy[1]

    pipe = dk.Pipeline(nn.Sequential(Add(), nn.Linear(3, 3)), ["cpu", "cpu"], chunks=4, balance=[1, 1])
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(pipe((a, b)), pipe.module((a, b)))
    assert pipe.last_run is not None and pipe.last_run.microbatches == 2


def test_schedule_and_predicted_bubble() -> None:
    ticks = list(clock_cycles(3, 2))
    assert ticks == [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    assert all(len(t) <= 2 for t in clock_cycles(8, 2)) and len(list(clock_cycles(8, 4))) == 11
    assert bubble_fraction(8, 2) == pytest.approx(1 / 9)
    pipe = dk.Pipeline(MODELS["mlp"](), ["cpu", "cpu"], chunks=4)
    pipe(sample_for("mlp"))
    run = pipe.last_run
    assert run is not None and run.predicted_idle_fraction == pytest.approx(1 / 5)
    assert 0.0 <= run.idle_fraction <= 1.0 and "idle" in str(run)


@pytest.mark.parametrize("kwargs, words", [
    ({"chunks": 0}, "chunks 0"),
    ({"chunks": 2, "checkpoint": "sometimes"}, "checkpoint 'sometimes'"),
])
def test_bad_pipeline_options(kwargs: dict, words: str) -> None:
    with pytest.raises(dk.InvalidValueError, match=words):
        dk.Pipeline(MODELS["mlp"](), ["cpu", "cpu"], **kwargs)


class Pair(NamedTuple):
    x: torch.Tensor
    mask: torch.Tensor


class ToPair(nn.Module):
    def forward(self, x: torch.Tensor) -> Pair:
        return Pair(torch.tanh(x), (x > 0).float())


class FromPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, p: Pair) -> dict[str, Any]:
        return {"out": self.linear(p.x) * p.mask, "kind": "pair"}  # attribute access: p.x


def test_namedtuples_and_dicts_keep_their_type_through_split_and_pipeline() -> None:
    """Issue 14 item 3: a namedtuple activation came out of the micro-batch walk as a plain
    tuple ('tuple' object has no attribute 'x'). One walker (map_tensors) now keeps it."""
    torch.manual_seed(0)
    model = nn.Sequential(ToPair(), FromPair())
    x = torch.randn(6, 4, requires_grad=True)
    want = model(x)
    split = dk.split(copy.deepcopy(model), ["cpu", "cpu"], balance=[1, 1])  # a split model has hooks
    pipe = dk.Pipeline(model, ["cpu", "cpu"], chunks=3, balance=[1, 1], checkpoint="never")
    for runner in (split, pipe):
        got = runner(x)
        assert got["kind"] == "pair"
        torch.testing.assert_close(got["out"], want["out"])
    pipe.close()
    batch = {"p": Pair(torch.ones(4, 2), torch.zeros(4, 2)), "flag": True}
    from devicekit.modelparallel.microbatch import gather, scatter

    parts = scatter(batch, 2)
    assert [type(p["p"]) for p in parts] == [Pair, Pair] and parts[0]["flag"] is True
    joined = gather(parts)
    assert isinstance(joined["p"], Pair) and torch.equal(joined["p"].x, batch["p"].x)
