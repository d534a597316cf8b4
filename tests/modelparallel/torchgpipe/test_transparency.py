"""Port of torchgpipe tests/test_transparency.py: a pipeline's gradients are the model's."""

from __future__ import annotations

import torch
from torch import nn

import devicekit as dk


def test_simple_linears() -> None:
    """upstream test_simple_linears"""

    def sum_grad(parameters: object) -> torch.Tensor:
        return sum(p.grad.sum() for p in parameters if p.grad is not None)  # type: ignore[attr-defined, return-value]

    inputs = torch.rand(8, 1)
    model = nn.Sequential(nn.Linear(1, 2), nn.Linear(2, 4), nn.Linear(4, 2), nn.Linear(2, 1))
    model(inputs).mean().backward()
    without = sum_grad(model.parameters())
    model.zero_grad()
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=4, balance=[2, 2]) as pipe:
        pipe(inputs).mean().backward()
    torch.testing.assert_close(sum_grad(pipe.parameters()), without)
