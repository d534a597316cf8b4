"""The second step's peak read from the first step's timeline equals two fake steps run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from devicekit.memory.fake_step import fake_step
from devicekit.memory.losses import cross_entropy_loss
from tests.memory.zoo import ZOO

CPU = torch.device("cpu")


def _both(model: torch.nn.Module, sample: Any, **kwargs: Any) -> tuple[Any, Any]:
    read = fake_step(model, sample, device=CPU, **kwargs)
    ran = fake_step(model, sample, device=CPU, read_second=False, **kwargs)
    return read, ran


@pytest.mark.parametrize(("name", "optimizer"), [
    ("mlp", "adam"),                 # peaks in the optimizer step: its state named as such
    ("gpt-tied", "adam"),            # the logits kept until the next forward returns
    ("resnet", "sgd-momentum"),      # momentum buffers made in the first step
    ("encoder-bf16", "adamw"),       # autocast copies
    ("checkpointed", "adam"),
])
def test_the_read_second_step_is_the_run_one(name: str, optimizer: str) -> None:
    case = ZOO[name]
    torch.manual_seed(0)
    read, ran = _both(case.build(), case.sample(8), optimizer=optimizer, loss_fn=case.loss,
                      precision=case.precision, keep_output=True)
    assert read == ran


def test_a_step_that_returns_nothing_and_no_optimizer() -> None:
    case = ZOO["gpt-tied"]
    torch.manual_seed(0)
    model, tokens = case.build(), case.sample(4)

    def step(m: torch.nn.Module, batch: torch.Tensor) -> None:
        cross_entropy_loss(m(batch), batch).backward()

    read, ran = _both(model, tokens, step=step)
    assert read == ran
    read, ran = _both(model, tokens, optimizer=None, loss_fn=cross_entropy_loss, keep_output=True)
    assert read == ran


def test_an_lstm_the_same() -> None:
    """oneDNN's LSTM backward: the meta kernel returned one tensor for both bias gradients (the
    real kernel two), so autograd copied it, or not where torch's fake cache had the op; the
    read step was 4 KiB off the run one until real_kernels gave the backward two tensors."""
    case = ZOO["lstm"]
    torch.manual_seed(0)
    read, ran = _both(case.build(), case.sample(8), loss_fn=case.loss, keep_output=True)
    assert read == ran


def test_workspaces_made_in_the_first_step_are_held_through_the_second(monkeypatch) -> None:
    """cuBLAS's workspaces (a counter, not storages) exist from the second step's start."""
    from devicekit.memory import fake_step as module
    from devicekit.memory.cuda_terms import BlasWorkspaces

    class WithWorkspaces(module.LiveBytes):
        def __init__(self, device_type: str) -> None:
            super().__init__(device_type, workspaces=BlasWorkspaces(32 << 20))

    monkeypatch.setattr(module, "LiveBytes", WithWorkspaces)
    for name in ("mlp", "gpt-tied"):
        case = ZOO[name]
        torch.manual_seed(0)
        read, ran = _both(case.build(), case.sample(8), loss_fn=case.loss, keep_output=True)
        assert read == ran and read[1][module.CUDA_WORKSPACES] > 0, (name, read, ran)
