"""Port of torchgpipe tests/test_inplace.py to dk.Pipeline.

In-place operations on a checkpointed part's input make the recomputation start from the
modified input. torchgpipe raises for one case and marks two as known failures (one gives a
silently wrong gradient). devicekit gives a part whose first layer works in place
(``nn.ReLU(inplace=True)``) a copy of its input inside the checkpoint, so those run right, and
checks the input's version counter on the first run to refuse any other in-place change of a
part's input with one line (dk.SplitError naming the part): that is the difference.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import devicekit as dk


def test_inplace_on_requires_grad() -> None:
    """upstream test_inplace_on_requires_grad (autograd's RuntimeError upstream): a part whose
    first layer is in place (nn.ReLU(inplace=True), where the balancer may cut any CNN) gets a
    copy of its input inside the checkpoint, so outputs and gradients equal the unsplit model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True))
    x = torch.randn(4, 3)
    reference = copy.deepcopy(model)
    want = reference(x)
    want.sum().backward()
    pipe = dk.Pipeline(model, ["cpu", "cpu"], chunks=2, balance=[1, 1], checkpoint="always")
    out = pipe(x)
    out.sum().backward()
    torch.testing.assert_close(out, want)
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad)


def test_inplace_on_not_requires_grad() -> None:
    """upstream test_inplace_on_not_requires_grad (xfail upstream: "we cannot detect this"):
    runs, with the right result, and the caller's batch is left as it was."""
    x = torch.tensor([-1.0, 2.0])
    pipe = dk.Pipeline(nn.Sequential(nn.ReLU(inplace=True)), ["cpu"], chunks=1, checkpoint="always")
    torch.testing.assert_close(pipe(x), torch.tensor([0.0, 2.0]))
    torch.testing.assert_close(x, torch.tensor([-1.0, 2.0]))


def test_inplace_incorrect_grad() -> None:
    """upstream test_inplace_incorrect_grad (xfail upstream: foo's gradient comes out 3, not 2,
    because bar.add_(1) runs twice). devicekit refuses instead of a wrong gradient; with
    checkpoint='never' the gradient is right."""

    class M(nn.Module):
        def forward(self, foo_bar: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            foo, bar = foo_bar
            bar.add_(1)
            return foo * bar

    foo = torch.tensor([1.0], requires_grad=True)
    pipe = dk.Pipeline(nn.Sequential(M()), ["cpu"], chunks=1, checkpoint="always")
    with pytest.raises(dk.SplitError, match="checkpoint='never'"):
        pipe((foo, torch.tensor([1.0])))
    pipe = dk.Pipeline(nn.Sequential(M()), ["cpu"], chunks=1, checkpoint="never")
    pipe((foo, torch.tensor([1.0]))).backward()
    assert foo.grad is not None and foo.grad.item() == 2.0


def test_inplace_inside_a_part_is_fine() -> None:
    """Not upstream: an in-place op on a part's own intermediate (not its input) is allowed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True))
    x = torch.randn(8, 4)
    want = model(x)
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=4, balance=[2, 2], checkpoint="always") as pipe:
        out = pipe(x)
        out.sum().backward()
    torch.testing.assert_close(out, want)
