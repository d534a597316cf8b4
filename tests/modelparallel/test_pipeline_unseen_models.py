"""dk.Pipeline on set-ups its first tests never met (issue 45): each once wrong, refused or crashing."""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

import devicekit as dk


class SlowDropout(nn.Dropout):
    """Dropout that draws only after a pause, so overlapped stages would draw in another order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.003)
        return super().forward(x)


def test_checkpoint_never_with_dropout_gives_the_same_logits_every_call_and_the_defaults() -> None:
    """checkpoint="never" let stages sharing the CPU generator draw dropout masks concurrently: the
    same seed gave other outputs call to call, and other than the default checkpoint's (item 1)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3), nn.Linear(16, 16), SlowDropout(0.3), nn.Linear(16, 4))
    x = torch.randn(16, 16)
    runs = {}
    for mode in ("never", "except_last"):
        with dk.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=4, balance=[2, 3], checkpoint=mode) as pipe:
            for call in range(3):
                torch.manual_seed(7)
                runs[mode, call] = pipe(x).detach()
    for key, out in runs.items():
        assert torch.equal(out, runs["except_last", 0]), key


class StemNet(nn.Module):
    """A ResNet-like stem: the activation after the first BatchNorm works in place."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.Hardswish(inplace=True))
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        return self.fc(self.layer1(x).mean((2, 3)))


def test_a_traced_part_that_starts_in_place_is_checkpointed_from_a_copy() -> None:
    """stages=["relu", "layer1"] on a ResNet made a part that starts with ReLU(inplace=True):
    refused as "modified its input in place", since only nn.Sequential parts were looked into (item 8)."""
    torch.manual_seed(0)
    model, x = StemNet(), torch.randn(4, 3, 8, 8)
    ref = copy.deepcopy(model)
    ref(x).sum().backward()
    with dk.Pipeline(model, ["cpu"] * 3, chunks=1, stages=["relu", "layer1"], checkpoint="always") as pipe:
        assert len(pipe.plan.parts) == 3
        pipe(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
