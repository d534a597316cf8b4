"""DistributedDataParallel set-up: the right device, a sampler that reshuffles, uneven inputs, checkpoints.

Usage (inside every rank, e.g. a script started by ``devicekit run`` or ``torchrun``)::

    import devicekit as dk

    dk.dist.init()                                   # process group + this rank's GPU
    model = dk.ddp(build_model())                    # to this rank's device, wrapped in DDP
    loader = dk.distributed_loader(dataset, batch_size=32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in dk.epochs(loader, 10):              # calls sampler.set_epoch(epoch) for you
        with dk.join(model):                         # ranks with fewer batches do not hang
            for x, y in loader:
                x, y = dk.to_device((x, y), dk.device_of(model))
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()
        dk.save_ddp_checkpoint(model, optimizer, "ckpt.pt", epoch=epoch)  # rank 0 writes

    extra = dk.load_ddp_checkpoint(model, optimizer, "ckpt.pt")   # each rank onto its own device

Without an initialised process group (or with world size 1) :func:`ddp` returns the model moved
to the device and *not* wrapped, and the sampler covers the whole dataset, so the same script
runs as a plain single-process job.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from devicekit.errors import CheckpointError, InvalidValueError, PlacementError
from devicekit.parallel.rank import is_distributed, rank_device

__all__ = [
    "ddp",
    "rank_device",
    "unwrap_model",
    "is_distributed",
    "distributed_sampler",
    "distributed_loader",
    "epochs",
    "join",
    "save_ddp_checkpoint",
    "load_ddp_checkpoint",
]


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / DataParallel / BalancedDataParallel / torch.compile wrappers."""
    from devicekit.parallel.balanced_dp import BalancedDataParallel

    while True:
        if isinstance(model, (DistributedDataParallel, nn.DataParallel, BalancedDataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod  # torch.compile's OptimizedModule
        else:
            return model


def _model_devices(model: nn.Module) -> set[torch.device]:
    return {t.device for t in [*model.parameters(), *model.buffers()]}


def ddp(model: nn.Module, *, device: torch.device | str | int | None = None,
        find_unused_parameters: bool = False, loader: Any = None, **ddp_kwargs: Any) -> nn.Module:
    """Move ``model`` to this rank's device and wrap it in DistributedDataParallel.

    ``device`` defaults to :func:`rank_device` (the GPU ``dk.dist.init`` bound this rank to, or
    the CPU for gloo). DDP gets ``device_ids=[device]`` on CUDA and ``None`` on the CPU; a model
    already spread over several devices (model parallel) is left where it is with
    ``device_ids=None``. Other keyword arguments go to DDP unchanged.

    When ``torch.distributed`` is not initialised, or the world size is 1, the model is moved
    to the device and returned **unwrapped**: DDP would only add overhead.

    ``loader``: a loader from ``distributed_loader(..., weights=...)`` whose ranks get unequal
    batches; gradients are then averaged by each rank's share of the global batch (a DDP
    communication hook), so they equal the one-process gradient of the whole batch.
    """
    wrapped = _ddp(model, device=device, find_unused_parameters=find_unused_parameters,
                   **ddp_kwargs)
    if loader is not None:
        from devicekit.parallel.weighted_loader import weight_gradients

        weight_gradients(wrapped, loader)
    return wrapped


def _ddp(model: nn.Module, *, device: torch.device | str | int | None,
         find_unused_parameters: bool, **ddp_kwargs: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise InvalidValueError(f"ddp() needs an nn.Module, got {type(model).__name__}")
    for key in ("device_ids", "output_device"):
        if key in ddp_kwargs:
            raise InvalidValueError(
                f"ddp() chooses {key} itself; got {key}={ddp_kwargs[key]!r}: pass device= instead")
    if isinstance(model, DistributedDataParallel):
        return model
    devices = _model_devices(model)
    spread = len(devices) > 1
    if spread and device is not None:
        raise PlacementError(
            f"model spans {sorted(map(str, devices))}; do not pass device={device!r} for a "
            f"model split across devices")
    if not spread:
        target = rank_device() if device is None else _as_device(device)
        model = model.to(target)
    if not is_distributed():
        return model
    if spread:
        return DistributedDataParallel(model, device_ids=None, output_device=None,
                                       find_unused_parameters=find_unused_parameters,
                                       **ddp_kwargs)
    if target.type == "cuda":
        index = target.index if target.index is not None else torch.cuda.current_device()
        return DistributedDataParallel(model, device_ids=[index], output_device=index,
                                       find_unused_parameters=find_unused_parameters,
                                       **ddp_kwargs)
    return DistributedDataParallel(model, device_ids=None,
                                   find_unused_parameters=find_unused_parameters, **ddp_kwargs)


def _as_device(device: torch.device | str | int) -> torch.device:
    try:
        if isinstance(device, int):
            return torch.device("cuda", device)
        return torch.device(device)
    except (RuntimeError, TypeError):
        from devicekit.errors import InvalidDeviceError

        raise InvalidDeviceError(
            f"unknown device {device!r}; use e.g. 'cpu', 'cuda', 'cuda:1' or a GPU index") from None


def distributed_sampler(dataset: Dataset, *, shuffle: bool = True, seed: int = 0,
                        drop_last: bool = False) -> DistributedSampler:
    """A DistributedSampler giving this rank its share of ``dataset``.

    Without a process group it covers the whole dataset (one replica), so the same code runs on
    one process; either way it has ``set_epoch`` (use :func:`epochs`), and shuffles with
    ``seed + epoch`` identically on every rank. ``drop_last=False`` pads with repeated samples
    so every rank gets the same count; ``True`` drops the tail instead.
    """
    if dist.is_available() and dist.is_initialized():
        replicas, rank = dist.get_world_size(), dist.get_rank()
    else:
        replicas, rank = 1, 0
    return DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle,
                              seed=seed, drop_last=drop_last)


def distributed_loader(dataset: Dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                       drop_last: bool = False, weights: Any = None,
                       **loader_kwargs: Any) -> DataLoader:
    """A DataLoader over this rank's share of ``dataset`` (see :func:`distributed_sampler`).

    ``drop_last`` applies to both the sampler and the loader, so with ``True`` every rank gets
    the same number of full batches. Other keywords (``num_workers``, ``pin_memory``, ...) go to
    the DataLoader; ``sampler``/``batch_sampler`` are chosen here and cannot be given.

    ``weights`` (one number per rank, or ``"auto"`` from each rank's GPU capability score):
    mixed GPUs. Each step's global batch of ``batch_size`` x world size samples is shared in
    proportion (``loader.batch_sizes``), so the fast GPU does not wait; gradients stay the
    per-sample mean with ``dk.ddp(model, loader=loader)`` or ``loss * loader.loss_scale``
    (see :mod:`devicekit.parallel.weighted_loader`).
    """
    for key in ("sampler", "batch_sampler"):
        if key in loader_kwargs:
            raise InvalidValueError(
                f"distributed_loader() builds the sampler itself; drop {key}= or build the "
                f"DataLoader yourself with dk.distributed_sampler()")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidValueError(f"batch_size={batch_size!r} must be a positive integer")
    if weights is not None:
        from devicekit.parallel.weighted_loader import build_weighted_loader

        return build_weighted_loader(dataset, batch_size, weights, shuffle=shuffle, seed=seed,
                                     drop_last=drop_last, **loader_kwargs)
    sampler = distributed_sampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                      **loader_kwargs)


def _epoch_setter(loader: Any) -> Any:
    batch_sampler = getattr(loader, "batch_sampler", None)
    for holder in (loader, getattr(loader, "sampler", None), batch_sampler,
                   getattr(batch_sampler, "sampler", None)):
        if holder is not None and callable(getattr(holder, "set_epoch", None)):
            return holder.set_epoch
    return None


def epochs(loader: Any, n: int, *, start: int = 0) -> Iterator[int]:
    """Yield epoch numbers ``start .. n-1``, calling ``set_epoch`` on the loader's sampler first.

    Forgetting ``sampler.set_epoch(epoch)`` makes a DistributedSampler repeat the same order
    every epoch; this does it for you. Loaders whose sampler has no ``set_epoch`` (a plain
    shuffling DataLoader) are fine too: nothing needs to be called.
    """
    if not isinstance(n, int) or n < 0 or not isinstance(start, int) or start < 0:
        raise InvalidValueError(f"epochs(n={n!r}, start={start!r}) needs non-negative integers")
    set_epoch = _epoch_setter(loader)
    for epoch in range(start, n):
        if set_epoch is not None:
            set_epoch(epoch)
        yield epoch


def join(model: nn.Module, optimizer: Any = None, *, enable: bool = True,
         throw_on_early_termination: bool = False,
         **join_kwargs: Any) -> contextlib.AbstractContextManager[Any]:
    """Context manager for uneven inputs: ranks that run out of batches early keep shadowing
    the others' gradient all-reduces instead of leaving them hanging (torch's ``Join``).

    On exit the final parameters are broadcast from the last rank to finish, so every rank ends
    with the same model. ``optimizer`` is joined too when it is a ``Joinable`` (e.g.
    ``ZeroRedundancyOptimizer``); ordinary optimizers need no collective and are ignored.
    Extra keywords (``divide_by_initial_world_size``) go to the join hooks. For a model that is
    not DDP (single process) this is a no-op context.
    """
    if not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    from torch.distributed.algorithms.join import Join, Joinable

    joinables: list[Any] = [model]
    if isinstance(optimizer, Joinable):
        joinables.append(optimizer)
    return Join(joinables, enable=enable, throw_on_early_termination=throw_on_early_termination,
                **join_kwargs)


_RESERVED = ("model", "optimizer")


def save_ddp_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                        path: str | Path, /, **extra: Any) -> None:
    """Save the unwrapped model's state dict (no ``module.`` prefix), the optimizer's, and ``extra``.

    Goes through :func:`devicekit.save_checkpoint`: an atomic write by rank 0 only, after which
    every rank waits at a barrier, so the file is complete when any rank returns. The saved
    state loads into a plain, unwrapped model too.
    """
    clash = [key for key in _RESERVED if key in extra]
    if clash:
        raise InvalidValueError(f"extra key {clash[0]!r} is reserved; pick another name")
    from devicekit.placement.checkpoint import save_checkpoint

    state: dict[str, Any] = {"model": unwrap_model(model).state_dict()}
    if optimizer is not None:
        optimizer_state = _full_optimizer_state(optimizer)
        if optimizer_state is not None:  # None: a ZeRO rank other than 0, which does not write
            state["optimizer"] = optimizer_state
    state.update(extra)
    save_checkpoint(state, path)


def _full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The whole optimizer's state dict; for ``ZeroRedundancyOptimizer`` (each rank holds a shard)
    every rank joins the consolidation onto rank 0, which alone gets the state (it alone writes).
    Its ``load_state_dict`` takes that full state on every rank and keeps each rank's shard."""
    # An optimizer can only be a ZeroRedundancyOptimizer if its module is already imported;
    # importing it just for the isinstance check prints torch's 8 `torch.jit.script is
    # deprecated` warnings (torch.distributed.optim scripts its functional optimizers) per rank.
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is None or not isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return optimizer.state_dict()
    import torch.distributed as dist

    optimizer.consolidate_state_dict(to=0)  # a collective: every rank must call it
    return optimizer.state_dict() if dist.get_rank() == 0 else None


def load_ddp_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                        path: str | Path, *, map_location: Any = None, strict: bool = True,
                        weights_only: bool = True) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_ddp_checkpoint`; return its extra entries.

    Every rank reads the file through :func:`devicekit.load_checkpoint`, which maps tensors onto
    this process's own device (the seeds' ``map_location`` advice) unless ``map_location`` says
    otherwise. Works for DDP-wrapped or plain models, and for state dicts saved with a
    ``module.`` prefix by a hand-written ``torch.save(ddp_model.state_dict())``.
    """
    from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

    from devicekit.placement.checkpoint import load_checkpoint

    state = load_checkpoint(path, map_location=map_location, weights_only=weights_only)
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(
            f"{str(path)!r} has no 'model' entry; it was not written by save_ddp_checkpoint "
            f"(use dk.load_checkpoint for other files)")
    model_state = dict(state["model"])
    consume_prefix_in_state_dict_if_present(model_state, "module.")
    unwrap_model(model).load_state_dict(model_state, strict=strict)
    if optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointError(
                f"{str(path)!r} holds no optimizer state; pass optimizer=None to load the model only")
        optimizer.load_state_dict(state["optimizer"])
    return {key: value for key, value in state.items() if key not in _RESERVED}
