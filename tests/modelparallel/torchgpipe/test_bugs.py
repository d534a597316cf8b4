"""Port of torchgpipe tests/test_bugs.py to dk.Pipeline (each test names its upstream test)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import devicekit as dk


def test_python_autograd_function() -> None:
    """upstream test_python_autograd_function: identity autograd Functions pass through stages."""

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return x

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return grad

    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Identity.apply(x)

    for chunks in (1, 2):
        pipe = dk.Pipeline(nn.Sequential(M(), M()), ["cpu", "cpu"], chunks=chunks, balance=[1, 1],
                           checkpoint="always")
        x = torch.rand(42)
        torch.testing.assert_close(pipe(x), x)
        pipe.close()


def test_exception_no_hang() -> None:
    """upstream test_exception_no_hang: a failing last stage with more micro-batches to come."""

    class Pass(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    class Raise(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("expected")

    pipe = dk.Pipeline(nn.Sequential(Pass(), Pass(), Raise()), ["cpu"] * 3, chunks=3, balance=[1, 1, 1])
    for _ in range(2):  # and again: the failed call left the pipeline usable
        with pytest.raises(ValueError, match="expected"):
            pipe(torch.rand(3))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="upstream test_tuple_wait needs 2 CUDA devices")
def test_tuple_wait() -> None:
    """upstream test_tuple_wait: every tensor of a tuple activation is synchronised, not only the
    first (a slow backward on one of them must still be waited for)."""

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return x.detach()

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            with torch.cuda.device(grad.device):
                torch.cuda._sleep(50_000_000)
            return grad

    class Layer1(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
            a, b = pair
            return a * 1, b * 2, b * 3

    class Layer2(nn.Module):
        def forward(self, triple: tuple[torch.Tensor, ...]) -> torch.Tensor:
            a, b, c = triple
            return a + Sleep.apply(b) + c

    pipe = dk.Pipeline(nn.Sequential(Layer1(), Layer2()), [0, 1], chunks=32, balance=[1, 1], checkpoint="never")
    a = torch.rand(1024, 3, 32, 32, device=0, requires_grad=True)
    b = torch.rand(1024, 3, 32, 32, device=0, requires_grad=True)
    pipe((a, b)).norm().backward()
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert b.grad is not None
    assert torch.isclose(b.grad.norm().cpu(), torch.tensor(5.000))


def test_parallel_randoms() -> None:
    """upstream test_parallel_randoms: 100 functional dropouts per stage on two CPU stages (one
    generator); the input's gradient is zero exactly where the output is. Failed on devicekit
    before issue 9: the stage threads interleaved their draws, so replay used other masks."""

    class Dropouts(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(100):
                x = F.dropout(x, p=0.001)
            return x

    x = torch.rand(10, 10, requires_grad=True)
    with dk.Pipeline(nn.Sequential(Dropouts(), Dropouts()), ["cpu", "cpu"], chunks=10, balance=[1, 1],
                     checkpoint="always") as pipe:
        y = pipe(x)
        y.norm().backward()
    assert x.grad is not None
    assert y.bool().tolist() == x.grad.bool().tolist()
