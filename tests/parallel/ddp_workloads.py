"""Functions that run inside gloo ranks for the DDP tests (module level: sent to spawned ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import devicekit as dk


def build_net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in dk.unwrap_model(model).parameters()])


def train_steps(steps: int) -> dict[str, Any]:
    """Each rank starts from different weights and sees different data; DDP keeps them equal."""
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)                 # deliberately different initial weights
    model = dk.ddp(build_net())
    initial = flat_params(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        x, y = torch.randn(8, 6), torch.randn(8, 2)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {"wrapped": type(model).__name__, "device_ids": model.device_ids,
            "device": str(dk.unwrap_model(model)[0].weight.device),
            "initial": initial, "final": flat_params(model)}


def uneven_batches_with_join() -> dict[str, Any]:
    """Rank r has 2 + 3 r batches; without Join the rank with more batches would hang."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = dk.ddp(build_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    done = 0
    with dk.join(model, optimizer):
        for _ in range(2 + 3 * rank):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 2)).backward()
            optimizer.step()
            done += 1
    return {"batches": done, "final": flat_params(model)}


def sampler_shards(size: int) -> dict[str, Any]:
    """Indices this rank's loader yields in epochs 0 and 1."""
    dataset = torch.utils.data.TensorDataset(torch.arange(size))
    loader = dk.distributed_loader(dataset, batch_size=2, seed=7)
    seen: dict[int, list[int]] = {}
    for epoch in dk.epochs(loader, 2):
        seen[epoch] = [int(i) for (batch,) in loader for i in batch]
    return seen


def checkpoint_round_trip(path: str) -> dict[str, Any]:
    """Train one step, save through rank 0, load on every rank into a fresh plain model."""
    torch.manual_seed(0)
    model = dk.ddp(build_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 2)).backward()
    optimizer.step()

    saves = []
    real_save = torch.save

    def counting_save(*args: Any, **kwargs: Any) -> Any:
        saves.append(1)
        return real_save(*args, **kwargs)

    torch.save = counting_save
    try:
        dk.save_ddp_checkpoint(model, optimizer, path, epoch=3)
    finally:
        torch.save = real_save
    exists_after_save = Path(path).exists()

    fresh = build_net()
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    extra = dk.load_ddp_checkpoint(fresh, fresh_optimizer, path)
    momentum = next(iter(fresh_optimizer.state.values()))["momentum_buffer"]
    return {"saves": len(saves), "exists_after_save": exists_after_save, "extra": extra,
            "saved": flat_params(model), "loaded": flat_params(fresh),
            "loaded_device": str(next(fresh.parameters()).device),
            "momentum_device": str(momentum.device)}


def zero_checkpoint_round_trip(path: str) -> dict[str, Any]:
    """ZeroRedundancyOptimizer: each rank holds a shard of Adam's state; the checkpoint must hold
    all of it (consolidated on rank 0) and load back into a fresh ZeRO optimizer on every rank."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def build() -> tuple[nn.Module, ZeroRedundancyOptimizer]:
        torch.manual_seed(0)
        model = dk.ddp(build_net())
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                              lr=0.01)

    model, optimizer = build()
    for _ in range(2):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 2)).backward()
        optimizer.step()
    dk.save_ddp_checkpoint(model, optimizer, path)
    fresh, fresh_optimizer = build()
    dk.load_ddp_checkpoint(fresh, fresh_optimizer, path)
    def shard(zero: ZeroRedundancyOptimizer) -> list[torch.Tensor]:  # in this rank's parameter order
        return [zero.optim.state[p]["exp_avg"] for group in zero.optim.param_groups
                for p in group["params"] if p in zero.optim.state]

    own, loaded = shard(optimizer), shard(fresh_optimizer)
    return {"own_shard": own, "loaded_shard": loaded, "loaded_params": flat_params(fresh),
            "saved_params": flat_params(model)}


def all_scenarios(checkpoint_path: str | None) -> dict[str, Any]:
    """Every scenario in one process group: each DDP start-up imports torch._dynamo (seconds)."""
    results = {"train": train_steps(3), "join": uneven_batches_with_join(),
               "sampler": sampler_shards(12), "equivalence": equivalence_in_job()}
    if checkpoint_path is not None:
        results["checkpoint"] = checkpoint_round_trip(checkpoint_path)
        results["zero"] = zero_checkpoint_round_trip(checkpoint_path + ".zero")
    return results


def rank_one_fails() -> str:
    """Rank 1 raises; rank 0 waits in a barrier that will never complete."""
    if dist.get_rank() == 1:
        raise ValueError("bad shard on rank 1")
    dist.barrier()
    return "unreachable"


def equivalence_in_job() -> dict[str, Any]:
    """check_equivalence called inside a running 2-rank job uses the job's ranks."""
    gen = torch.Generator().manual_seed(3 + dist.get_rank())   # rank 0's batch is broadcast
    batch = (torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen))
    good = dk.check_equivalence(build_net, batch, nn.MSELoss())
    summed = dk.check_equivalence(build_net, batch, nn.MSELoss(reduction="sum"),
                                  raise_on_mismatch=False)
    return {"good": (good.passed, good.world_size),
            "summed": (summed.passed, summed.ratio, summed.diagnosis)}
