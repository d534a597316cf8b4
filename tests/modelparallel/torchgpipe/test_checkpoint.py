"""Port of torchgpipe tests/test_checkpoint.py to devicekit.modelparallel.recompute.

devicekit checkpoints with torch's non-reentrant scheme (saved-tensor hooks, written out in recompute.py); :func:`checkpointed` adds the
recomputation flag (:func:`is_recomputing`) and the in-place check. torchgpipe's own
Checkpointing class, fork/join phonies and ``is_checkpointing`` have no counterpart here.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit.modelparallel.recompute import checkpointed, is_recomputing


@pytest.mark.skip(reason="upstream test_serial_checkpoints tests torchgpipe's fork/join phony "
                         "dependencies, which devicekit does not have (torch's autograd orders backward)")
def test_serial_checkpoints() -> None:
    """upstream test_serial_checkpoints"""


def test_not_requires_grad() -> None:
    """upstream test_not_requires_grad. Difference: upstream's checkpoint output always requires
    grad (a phony trick); torch's checkpoint, as the plain function, does not when nothing does."""
    x = torch.rand(1)
    y = checkpointed(lambda t: t * 2, x)  # type: ignore[arg-type]
    assert not y.requires_grad
    torch.testing.assert_close(y, x * 2)


def test_not_requires_grad_with_parameter() -> None:
    """upstream test_not_requires_grad_with_parameter"""
    x = torch.rand(1)
    a = torch.rand(1, requires_grad=True)
    checkpointed(lambda t: t * a, x).backward()  # type: ignore[arg-type]
    assert a.grad is not None


def test_random_in_checkpoint() -> None:
    """upstream test_random_in_checkpoint: recomputation draws the forward's dropout mask."""
    dropout = nn.Dropout(p=0.5)
    torch.manual_seed(0)
    x = torch.randn(3, 3, requires_grad=True)
    dropout(x).norm().backward()
    torch.manual_seed(0)
    chk_x = torch.randn(3, 3, requires_grad=True)
    checkpointed(dropout, chk_x).norm().backward()
    torch.testing.assert_close(x.grad, chk_x.grad)


def test_detect_recomputing() -> None:
    """upstream test_detect_checkpointing_recomputing (is_checkpointing has no counterpart)."""
    logs: list[bool] = []

    class Detect(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            logs.append(is_recomputing())
            return x.sin()  # saves its input, so backward recomputes

    x = torch.rand(1, requires_grad=True)
    checkpointed(Detect(), x).backward()
    assert logs == [False, True]


def test_detect_recomputing_without_checkpoint() -> None:
    """upstream test_detect_checkpointing_recomputing_without_checkpoint"""
    logs: list[bool] = []

    class Detect(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            logs.append(is_recomputing())
            return x.sin()  # saves its input, so backward recomputes

    x = torch.rand(1, requires_grad=True)
    Detect()(x).backward()
    assert logs == [False]


def test_no_checkpointing_when_not_training() -> None:
    """upstream GPipe semantics (gpipe.py: checkpoint_stop = 0 unless training): a pipeline in
    eval() or under no_grad recomputes nothing."""
    logs: list[bool] = []

    class Detect(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            logs.append(is_recomputing())
            return super().forward(x)

    pipe = dk.Pipeline(nn.Sequential(Detect(2, 2)), ["cpu"], chunks=2, checkpoint="always")
    pipe.eval()
    pipe(torch.rand(4, 2)).sum().backward()
    pipe.train()
    with torch.no_grad():
        pipe(torch.rand(4, 2))
    assert logs == [False] * 4
    pipe(torch.rand(4, 2)).sum().backward()
    assert logs[4:] == [False, False, True, True]
