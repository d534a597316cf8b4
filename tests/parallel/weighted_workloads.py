"""Functions that run inside 3 gloo ranks for the weighted-loader tests (sent to spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import devicekit as dk

WEIGHTS = [3, 2, 1]
SAMPLES = 48


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(
        torch.arange(SAMPLES), torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 2, generator=g))


def build_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _gather(t: torch.Tensor) -> torch.Tensor:
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, t)
    return torch.cat(parts)


def _step_gradients(model: nn.Module, loader: Any, scale: float) -> dict[str, Any]:
    """One step on this rank's batch; and the one-process gradient of the whole global batch."""
    _, x, y = next(iter(loader))
    model.zero_grad()
    (nn.functional.mse_loss(model(x), y) * scale).backward()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    reference = build_net()
    nn.functional.mse_loss(reference(_gather(x)), _gather(y)).backward()
    want = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    return {"got": got, "want": want, "rows": len(x)}


def scenarios() -> dict[str, Any]:
    out: dict[str, Any] = {}
    # 1. shares and indices: 3:2:1 of a global batch of 4 x 3 = 12
    loader = dk.distributed_loader(dataset(), batch_size=4, weights=WEIGHTS, seed=3)
    out["batch_sizes"] = loader.batch_sizes
    out["steps"] = len(loader)
    # 2. iterating before saying how gradients are weighted is refused
    try:
        next(iter(loader))
        out["refused"] = None
    except dk.InvalidValueError as exc:
        out["refused"] = str(exc)
    # 3. dk.ddp(model, loader=loader): the comm hook weights gradients by share
    model = dk.ddp(build_net(), loader=loader)
    seen = {}
    for epoch in dk.epochs(loader, 2):
        seen[epoch] = [int(i) for (idx, _, _) in loader for i in idx]
    out["indices"] = seen
    out["hook"] = _step_gradients(model, loader, 1.0)
    # 4. plain DDP + loss * loader.loss_scale gives the same gradient
    other = dk.distributed_loader(dataset(), batch_size=4, weights=WEIGHTS, seed=3)
    out["loss_scale"] = other.loss_scale
    out["scaled"] = _step_gradients(dk.ddp(build_net()), other, other.loss_scale)
    # 5. plain DDP, no weighting, to show what the refusal prevents (a different gradient)
    plain = dk.distributed_loader(dataset(), batch_size=4, weights=WEIGHTS, seed=3)
    plain.weighted.weighting_chosen = True  # force the wrong way, for the comparison only
    out["unweighted"] = _step_gradients(dk.ddp(build_net()), plain, 1.0)
    # 6. a wrong number of weights names the world size
    try:
        dk.distributed_loader(dataset(), batch_size=4, weights=[1, 1])
    except dk.InvalidValueError as exc:
        out["wrong_count"] = str(exc)
    # 7. 'auto' on CPU ranks: refused, naming the ranks
    try:
        dk.distributed_loader(dataset(), batch_size=4, weights="auto")
    except dk.InvalidValueError as exc:
        out["auto_cpu"] = str(exc)
    return out
