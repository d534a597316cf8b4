"""What the pipeline's tracer keeps (modelparallel/trace.py) and what building leaves alone.

Grad-mode blocks cut across stages, buffers written in forward (refused with chunks > 1, at
build or on the first call; never changed by building), defaulted keyword arguments, factories
sized from the batch, refusals for inference_mode and an unmatched set_grad_enabled.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit.modelparallel.state_guard import StateGuard
from devicekit.modelparallel.trace import trace_module
from tests.modelparallel.zoo_models import Counting, StopGradTarget


class NoGradAcrossCuts(nn.Module):
    """A no_grad block that holds two units, so a cut falls inside it; enable_grad nested in it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.frozen1 = nn.Linear(4, 4)
        self.frozen2 = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            f = self.frozen2(self.frozen1(h))
            with torch.enable_grad():
                g = self.inner(h)
        return self.head(h + f + g)


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_no_grad_block_cut_in_two_keeps_its_grad_mode(chunks: int) -> None:
    torch.manual_seed(0)
    model = NoGradAcrossCuts()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 4)
    stages = ["a", "frozen1", "frozen2", "inner", "head"]
    with dk.Pipeline(model, ["cpu"] * 5, chunks=chunks, stages=stages, sample=x) as pipe:
        pipe(x).sum().backward()
        assert torch.is_grad_enabled()  # each stage puts the caller's mode back
        with torch.no_grad():
            assert not pipe(x).requires_grad
            assert not torch.is_grad_enabled()
    ref(x).sum().backward()
    assert model.frozen1.weight.grad is None and model.frozen2.weight.grad is None
    for got, want in zip(model.parameters(), ref.parameters(), strict=True):
        assert (got.grad is None) == (want.grad is None)
        if got.grad is not None:
            torch.testing.assert_close(got.grad, want.grad)


def test_a_stop_gradient_target_gets_no_gradient() -> None:
    model = StopGradTarget()
    x = torch.randn(8, 6)
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=2, stages=["online", "target", "probe"], sample=x) as pipe:
        out = pipe(x)
        (out[0].sum() + out[1].sum()).backward()
    assert model.target.weight.grad is None and model.target.bias.grad is None
    assert model.online[0].weight.grad is not None and model.probe.weight.grad is not None


def test_buffers_written_in_forward_are_recorded_not_run_at_trace_time() -> None:
    model = Counting()
    gm = trace_module(model)
    assert int(model.steps) == 0  # plain torch.fx runs self.steps.add_(1) once here and drops it
    gm(torch.randn(3, 6))
    assert (int(model.steps), int(model.seen)) == (1, 3)


def test_buffers_written_in_forward_are_refused_and_never_changed() -> None:
    model = Counting()
    with pytest.raises(dk.SplitError, match=r"buffer 'steps' is written in its forward.*chunks=1"):
        dk.Pipeline(model, ["cpu", "cpu"], chunks=2, sample=torch.randn(8, 6))
    assert (int(model.steps), int(model.seen)) == (0, 0)
    pipe = dk.Pipeline(model, ["cpu", "cpu"], chunks=2)  # no sample: refused on the first call
    for _ in range(2):
        with pytest.raises(dk.SplitError, match=r"buffer 'steps' is written"):
            pipe(torch.randn(8, 6))
    assert (int(model.steps), int(model.seen)) == (0, 0)
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=1, sample=torch.randn(8, 6)) as one:
        assert (int(model.steps), int(model.seen)) == (0, 0)  # building ran the forward, undone
        one(torch.randn(8, 6))
    assert (int(model.steps), int(model.seen)) == (1, 8)  # one micro-batch: as the unsplit model


def test_state_guard_puts_back_replaced_and_written_buffers() -> None:
    bn = nn.BatchNorm1d(3)
    model = nn.Sequential(nn.Linear(3, 3), bn)
    model.register_buffer("ema", torch.zeros(3))
    ema = model.ema
    with StateGuard(model) as guard:
        model(torch.randn(4, 3))  # batch_norm writes its statistics without a new version
        model.ema = ema + 1  # replaced, not written in place
    assert model.ema is ema and torch.equal(ema, torch.zeros(3))
    assert torch.equal(bn.running_mean, torch.zeros(3)) and int(bn.num_batches_tracked) == 0
    assert guard.written == ["ema"]
    assert "1.running_mean" in guard.batch_norm_written


class Defaults(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 3.0) -> torch.Tensor:
        h = self.a(x)
        if mask is not None:
            h = h * mask
        t = x.size(1)
        return self.b(h) * scale + torch.ones(x.size(0), t, device=x.device)


def test_defaults_and_factories_sized_from_the_batch_trace() -> None:
    model = Defaults()
    x = torch.randn(6, 4)
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=3, sample=x) as pipe:
        torch.testing.assert_close(pipe(x), model(x))
        torch.testing.assert_close(pipe(x[:5]), model(x[:5]))


class InferenceInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.a(x)


class GradOffForever(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.set_grad_enabled(False)
        return self.a(x)


@pytest.mark.parametrize("model, reason", [(InferenceInside, "inference_mode"),
                                           (GradOffForever, r"set_grad_enabled\(\.\.\.\) without undoing")])
def test_grad_modes_it_cannot_cut_are_refused_by_name(model: type[nn.Module], reason: str) -> None:
    with pytest.raises(dk.SplitError, match=reason):
        dk.Pipeline(model(), ["cpu", "cpu"], chunks=2)
    assert torch.is_grad_enabled()


class CountingLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


def test_a_sequential_writing_a_buffer_is_refused_on_its_first_call_unchanged() -> None:
    model = nn.Sequential(CountingLayer(), nn.ReLU(), nn.Linear(6, 2))
    with pytest.raises(dk.SplitError, match=r"buffer '0\.calls' is written"):
        dk.Pipeline(model, ["cpu", "cpu"], chunks=2, sample=torch.randn(4, 6))
    pipe = dk.Pipeline(model, ["cpu", "cpu"], chunks=2)
    with pytest.raises(dk.SplitError, match=r"buffer '0\.calls' is written"):
        pipe(torch.randn(4, 6))
    assert int(model[0].calls) == 0
