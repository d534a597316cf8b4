"""A DLRM-like recommender: dense features through an MLP, sparse ids through sparse
EmbeddingBags, their pairwise dot products, a top MLP to one logit.

Shared by tests/memory/test_estimate_layouts.py and benchmarks/sweep_estimate_zoo.py.

Usage::

    from tests.memory.recommender import Recommender, recommender_batch

    model = Recommender()
    dense, ids, offsets = recommender_batch(256)
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Recommender", "recommender_batch"]

TABLES = (20_000, 5_000, 1_000)
DIM = 64
IDS_PER_BAG = 16


class Recommender(nn.Module):
    """``forward(dense, ids)``: dense (batch, 13) floats, ids (batch, tables, bag) longs."""

    def __init__(self, tables: tuple[int, ...] = TABLES, dim: int = DIM, sparse: bool = True) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(13, 128), nn.ReLU(), nn.Linear(128, dim), nn.ReLU())
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse) for rows in tables)
        pairs = (len(tables) + 1) * len(tables) // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        features = torch.stack([x, *(table(ids[:, i]) for i, table in enumerate(self.tables))], dim=1)
        dots = features @ features.transpose(1, 2)
        upper = torch.triu_indices(features.shape[1], features.shape[1], offset=1)
        return self.top(torch.cat([x, dots[:, upper[0], upper[1]]], dim=1))


def recommender_batch(batch: int, tables: tuple[int, ...] = TABLES, bag: int = IDS_PER_BAG,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense, ids) for ``batch`` rows; ids of shape (batch, tables, bag): the batch first."""
    dense = torch.randn(batch, 13)
    ids = torch.stack([torch.randint(0, rows, (batch, bag)) for rows in tables], dim=1)
    return dense, ids
