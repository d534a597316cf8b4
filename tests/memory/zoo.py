"""The zoo the estimate is held to: each model with its own loss, at sizes that run in seconds.

``ZOO[name] = Case(build, sample(batch), loss, precision, language_model)``: ``loss(output,
sample)`` is what the model's own training loop computes; ``language_model`` marks the
cross-entropy LMs the default estimate is checked on. Shared by tests/memory, tests/gpu and
benchmarks/bench_estimate.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from tests.memory.estimate_models import CheckpointedMLP, cnn, mlp

VOCAB = 2000


def class_loss(out: torch.Tensor, sample: Any) -> torch.Tensor:
    """Cross-entropy against 10 classes (targets made from the batch size)."""
    return functional.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long, device=out.device))


def lm_loss(out: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: logits (B, S, V) against the tokens."""
    return functional.cross_entropy(out.flatten(0, 1), tokens.flatten())


def mse_first(out: Any, sample: Any) -> torch.Tensor:
    """MSE of the first output (an RNN's sequence output) against zeros."""
    first = out[0] if isinstance(out, tuple) else out
    return functional.mse_loss(first, torch.zeros_like(first))


class Block(nn.Module):
    """A ResNet basic block."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def resnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
                         Block(32), Block(32), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


class ViT(nn.Module):
    """Patches by a strided conv, a class token, a transformer encoder, a linear head."""

    def __init__(self, dim: int = 96, patch: int = 4) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros(1, 65, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, batch_first=True, dropout=0.0, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patches(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.encoder(x)[:, 0])


def encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, dropout=0.1)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


class GPT(nn.Module):
    """Causal self-attention blocks; the output head shares the token embedding's weight."""

    def __init__(self, dim: int = 128, depth: int = 2, seq: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True, dropout=0.0, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        mask = torch.triu(torch.full((seq, seq), float("-inf"), device=tokens.device), diagonal=1)
        x = self.embed(tokens) + self.pos[:, :seq]
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))


class GRULM(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.rnn = nn.GRU(dim, hidden, 2, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(tokens))[0])


def lstm() -> nn.Module:
    return nn.LSTM(64, 256, 2, batch_first=True)


class RoutedMoE(nn.Module):
    """Top-1 routing to experts by ``nonzero``: shapes depend on values (fake tensors cannot run it)."""

    def __init__(self, dim: int = 128, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                     for _ in range(experts))
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, 1)
        choice = self.router(tokens).argmax(dim=-1)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            rows = (choice == index).nonzero().squeeze(1)
            out = out.index_add(0, rows, expert(tokens[rows]))
        return self.head(out.view_as(x).mean(dim=1))


def _tokens(n: int, d: Any = "cpu", seq: int = 32) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, seq), device=d)


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    sample: Callable[..., Any]
    loss: Callable[[Any, Any], torch.Tensor]
    precision: str | None = None
    language_model: bool = False


ZOO: dict[str, Case] = {
    "mlp": Case(mlp, lambda n, d="cpu": torch.randn(n, 512, device=d), class_loss),
    "cnn-batchnorm": Case(cnn, lambda n, d="cpu": torch.randn(n, 3, 32, 32, device=d), class_loss),
    "resnet": Case(resnet, lambda n, d="cpu": torch.randn(n, 3, 32, 32, device=d), class_loss),
    "vit": Case(ViT, lambda n, d="cpu": torch.randn(n, 3, 32, 32, device=d), class_loss),
    "encoder": Case(encoder, lambda n, d="cpu": torch.randn(n, 64, 128, device=d), mse_first),
    "gpt-tied": Case(GPT, _tokens, lm_loss, language_model=True),
    "lstm": Case(lstm, lambda n, d="cpu": torch.randn(n, 20, 64, device=d), mse_first),
    "gru-lm": Case(GRULM, lambda n, d="cpu": _tokens(n, d, 12), lm_loss, language_model=True),
    "encoder-bf16": Case(encoder, lambda n, d="cpu": torch.randn(n, 64, 128, device=d), mse_first, "bf16"),
    "checkpointed": Case(CheckpointedMLP, lambda n, d="cpu": torch.randn(n, 512, device=d), mse_first),
    "moe-routed": Case(RoutedMoE, lambda n, d="cpu": torch.randn(n, 16, 128, device=d), class_loss),
}
