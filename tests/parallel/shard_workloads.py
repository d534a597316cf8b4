"""What each rank runs in the dk.shard tests (module level: ranks import it)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

import devicekit as dk

GLOBAL_BATCH = 8


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch() -> torch.Tensor:
    torch.manual_seed(123)
    return torch.randn(GLOBAL_BATCH, 16)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a DTensor gathered; a plain tensor as is)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def train_and_save(checkpoint: str) -> dict[str, Any]:
    """Shard, one SGD step on this rank's part of the global batch, save; return full grads/params."""
    model = dk.shard(build())
    rank, world = tdist.get_rank(), tdist.get_world_size()
    per = GLOBAL_BATCH // world
    x = batch()[rank * per:(rank + 1) * per]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(x).pow(2).mean()
    loss.backward()
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    opt.step()
    params = {n: full(p) for n, p in model.named_parameters()}
    dk.save_checkpoint(model, checkpoint)
    blocks = sorted(type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP"))
    return {"grads": grads, "params": params, "fsdp_modules": blocks, "world": world}


def load_sharded(checkpoint: str) -> dict[str, torch.Tensor]:
    """A differently initialised model, sharded over this world, loaded from the checkpoint."""
    model = dk.shard(build(seed=99))
    dk.load_checkpoint(checkpoint, into=model)
    return {n: full(p) for n, p in model.named_parameters()}
