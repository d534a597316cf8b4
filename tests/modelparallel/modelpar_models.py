"""Small models and comparison helpers shared by the model-parallel tests."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))


def cnn_bn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def transformer() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True) for _ in range(2)]
    return nn.Sequential(nn.Embedding(50, 32), *layers, nn.LayerNorm(32), nn.Linear(32, 50))


def sample_for(name: str, batch: int = 8) -> torch.Tensor:
    torch.manual_seed(1)
    if name == "mlp":
        return torch.randn(batch, 16)
    if name == "cnn_bn":
        return torch.randn(batch, 3, 8, 8)
    return torch.randint(0, 50, (batch, 6))


MODELS: dict[str, Callable[[], nn.Sequential]] = {"mlp": mlp, "cnn_bn": cnn_bn, "transformer": transformer}


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out.float() ** 2).mean() + out.float().sum() * 0.01


def assert_same_grads(model: nn.Module, reference: nn.Module, atol: float = 1e-5) -> None:
    pairs = list(zip(model.parameters(), reference.parameters(), strict=True))
    assert pairs
    for (got, want) in pairs:
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad.cpu(), want.grad, atol=atol, rtol=1e-4)


def reference_run(factory: Callable[[], nn.Sequential], x: torch.Tensor,
                  chunks: int = 1) -> tuple[nn.Sequential, torch.Tensor]:
    """The unsplit model's output and grads (micro-batch by micro-batch when chunks > 1)."""
    ref = factory()
    out = torch.cat([ref(c) for c in x.chunk(chunks)]) if chunks > 1 else ref(x)
    loss_of(out).backward()
    return ref, out.detach()


def fresh(factory: Callable[[], nn.Sequential]) -> nn.Sequential:
    return copy.deepcopy(factory())
