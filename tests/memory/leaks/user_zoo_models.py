"""The model code of the user zoo: classes where users define them, and the zoo's helpers.

Classes that leak through a class attribute, an ``lru_cache`` method, a metrics object, a dataset
cache and a reference cycle live here, at module level, as they do in users' code; their growing
lines carry ``# LEAK-<case>`` markers that :func:`where` finds (in this file or in
:mod:`tests.memory.leaks.user_zoo_leaks`).

Usage::

    from tests.memory.leaks.user_zoo_models import X, small, train, where

    filename, lineno = where("LEAK-class-attribute")
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

X = torch.randn(8, 16)
#: files whose lines carry the zoo's markers
MARKED = (Path(__file__), Path(__file__).with_name("user_zoo_leaks.py"))


def where(marker: str) -> tuple[str, int]:
    """The file and line that end with ``# <marker>`` (exactly one)."""
    hits = [(str(path), i + 1) for path in MARKED for i, text in enumerate(path.read_text().splitlines())
            if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def small() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def train(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> torch.Tensor:
    loss = model(X).pow(2).mean()
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()
    else:
        model.zero_grad(set_to_none=True)
    return loss


# -- module-level classes (where users define them) -------------------------------------------

class CachingNet(nn.Module):
    cache: list[torch.Tensor] = []

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        CachingNet.cache.append(out)  # LEAK-class-attribute
        return out


class TimeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 16)

    @functools.lru_cache  # noqa: B019 - the leak under test
    def time_embedding(self, t: int) -> torch.Tensor:
        return self.fc(torch.full((1, 1), float(t))).expand(8, 16)

    def forward(self, x: torch.Tensor, t: int) -> torch.Tensor:
        return x + self.time_embedding(t)  # LEAK-lru-cache


class Meter:
    """A metrics object as users write them."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []

    def update(self, value: torch.Tensor) -> None:
        self.values.append(value)  # LEAK-metrics-object


class CachedDataset(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self) -> None:
        self.cache: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> torch.Tensor:
        if index not in self.cache:
            self.cache[index] = torch.randn(16)  # LEAK-dataset-cache
        return self.cache[index]


class Node:
    def __init__(self) -> None:
        self.me = self
        self.payload = torch.randn(256)


OUTPUTS: dict[int, torch.Tensor] = {}
