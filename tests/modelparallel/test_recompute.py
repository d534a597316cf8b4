"""devicekit's own recomputation (modelparallel/recompute.py): same gradients, no torch._dynamo import."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from devicekit.modelparallel.recompute import checkpointed


def _grads(model: nn.Module, x: torch.Tensor, recompute: bool, autocast: bool = False) -> list[torch.Tensor]:
    model.zero_grad()
    torch.manual_seed(3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # forward only: backward is outside
        out = checkpointed(model, x) if recompute else model(x)
    out.float().pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_dropout_and_autocast_recompute_to_the_same_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(5, 8, requires_grad=True)
    for got, want in zip(_grads(model, x, True), _grads(model, x, False), strict=True):
        torch.testing.assert_close(got, want)
    got, want = _grads(model, x, True, autocast=True), _grads(model, x, False, autocast=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_a_pipelines_first_training_call_does_not_import_torch_dynamo() -> None:
    """torch.utils.checkpoint imports torch._dynamo on its first call (about a second)."""
    code = ("import sys, torch; from torch import nn; import devicekit as dk\n"
            "pipe = dk.Pipeline(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), ['cpu', 'cpu'], chunks=2)\n"
            "pipe(torch.randn(4, 4)).sum().backward()\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
