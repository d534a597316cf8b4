"""Per-rank batches in proportion to each GPU's speed, with gradients that stay exact.

Seed 003: on mixed GPUs an equal split makes the fast GPU wait for the slow one. Here every
step's global batch (``batch_size`` x world size samples) is cut in proportion to ``weights``
(one number per rank, or ``"auto"`` from each rank's GPU capability score), so all ranks finish
a step together and run the same number of steps.

DDP averages gradients over ranks, which is the per-sample mean only when every rank has the
same batch. With unequal shares the average must be weighted by each rank's share of the
batch; two ways, and the loader refuses to run until one is chosen (a silently biased gradient
is the worst outcome):

- ``model = dk.ddp(net, loader=loader)``: a DDP communication hook weights each rank's
  gradients by its share (nothing else changes in the loop), or
- ``loss = loss_fn(out, y) * loader.loss_scale`` with any DDP wrapper.

Usage (inside every rank)::

    import devicekit as dk

    dk.dist.init()
    loader = dk.distributed_loader(dataset, batch_size=32, weights="auto")  # or [3, 2, 1]
    model = dk.ddp(build_model(), loader=loader)
    print(loader.batch_sizes)        # e.g. [48, 32, 16]: every rank's share of the 96
    for epoch in dk.epochs(loader, 10):
        for x, y in loader: ...
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from devicekit.errors import InvalidValueError
from devicekit.parallel.weighted_split import check_weights, split_sizes

__all__ = ["WeightedBatchSampler", "WeightedLoader", "rank_weights", "weight_gradients"]


class WeightedBatchSampler(Sampler[list[int]]):
    """This rank's slice of every global batch: ``sizes[rank]`` indices per step.

    Every rank draws the same order (``seed + epoch``); step ``s`` covers positions
    ``s*G .. (s+1)*G`` of it (``G = sum(sizes)``) and rank ``r`` takes its consecutive share.
    ``drop_last=True`` drops the tail. ``drop_last=False`` keeps it: with several ranks the
    order is padded with samples from its start so the last step is full too, and every
    rank's share, hence the gradient weighting, stays exact (``DistributedSampler`` pads the
    same way: at most ``G - 1`` repeated samples per epoch). A single rank needs no padding: its
    last batch is shorter and no sample repeats (issue 38: one GPU with ``weights="auto"``
    repeated samples ``[0, 1, 2, 3, 4, 4, ...]``).
    """

    def __init__(self, length: int, sizes: Sequence[int], rank: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        self.length = length
        self.sizes = list(sizes)
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        #: set when the caller has said how gradients are weighted (see the module docstring)
        self.weighting_chosen = len(set(self.sizes)) <= 1

    @property
    def global_batch(self) -> int:
        return sum(self.sizes)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if self.drop_last:
            return self.length // self.global_batch
        return math.ceil(self.length / self.global_batch)

    def __iter__(self) -> Iterator[list[int]]:
        if not self.weighting_chosen:
            raise InvalidValueError(
                f"this loader gives ranks unequal batches {self.sizes}, so DDP's plain average "
                "would weight samples unequally: wrap the model with dk.ddp(model, loader=loader) "
                "or multiply the loss by loader.loss_scale")
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=generator).tolist()
        else:
            order = list(range(self.length))
        steps = len(self)
        total = steps * self.global_batch
        while len(self.sizes) > 1 and order and len(order) < total:
            order += order[:total - len(order)]
        start = sum(self.sizes[:self.rank])
        mine = self.sizes[self.rank]
        for step in range(steps):
            first = step * self.global_batch + start
            yield order[first:first + mine]


class WeightedLoader(DataLoader):
    """A DataLoader whose batch sampler is a :class:`WeightedBatchSampler`."""

    @property
    def weighted(self) -> WeightedBatchSampler:
        sampler = self.batch_sampler
        assert isinstance(sampler, WeightedBatchSampler)
        return sampler

    @property
    def batch_sizes(self) -> list[int]:
        """Every rank's batch size, in rank order."""
        return list(self.weighted.sizes)

    @property
    def share(self) -> float:
        """This rank's share of each global batch (its gradient weight)."""
        return self.weighted.sizes[self.weighted.rank] / self.weighted.global_batch

    @property
    def loss_scale(self) -> float:
        """Multiply this rank's mean loss by this so DDP's average is the per-sample mean.

        Reading it tells the loader the loss is scaled (it then stops refusing to run).
        """
        self.weighted.weighting_chosen = True
        return self.share * len(self.weighted.sizes)


def rank_weights(weights: Any, world: int) -> list[float]:
    """One positive weight per rank: numbers as given, or ``"auto"`` (gathered from every rank)."""
    if weights == "auto":
        return _auto_weights(world)
    return check_weights(weights, world, f"a world of {world} rank(s)", "rank")


def _auto_weights(world: int) -> list[float]:
    from devicekit.parallel.rank import rank_device
    from devicekit.parallel.weighted_split import resolve_weights

    device = rank_device()
    local: float | None = None
    if device.type == "cuda":
        try:
            local = resolve_weights("auto", [device.index or 0])[0]
        except InvalidValueError:
            local = None
    gathered: list[float | None] = [local]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, local)  # every rank takes part, then all decide alike
    missing = [rank for rank, w in enumerate(gathered) if w is None]
    if missing:
        raise InvalidValueError(
            f"weights='auto' needs every rank on a known GPU; rank(s) {missing} are not: "
            "pass one number per rank, e.g. weights=[3, 2, 1]")
    return [float(w) for w in gathered if w is not None]


def build_weighted_loader(dataset: Dataset, batch_size: int, weights: Any, *, shuffle: bool,
                          seed: int, drop_last: bool, **loader_kwargs: Any) -> WeightedLoader:
    """The loader behind ``dk.distributed_loader(..., weights=...)``."""
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        world, rank = 1, 0
    sizes = split_sizes(batch_size * world, rank_weights(weights, world))
    if min(sizes) < 1:
        raise InvalidValueError(
            f"batch_size={batch_size} is too small to give each of {world} ranks a sample "
            f"with weights {weights!r}")
    length = len(dataset)  # type: ignore[arg-type]
    sampler = WeightedBatchSampler(length, sizes, rank, shuffle=shuffle, seed=seed,
                                   drop_last=drop_last)
    return WeightedLoader(dataset, batch_sampler=sampler, **loader_kwargs)


def _weighted_allreduce(share, bucket):  # type: ignore[no-untyped-def]
    # no annotations: DDP compares them with dist.GradBucket / Future objects, not strings
    tensor = bucket.buffer()
    tensor.mul_(share)
    future = dist.all_reduce(tensor, async_op=True).get_future()  # type: ignore[union-attr]
    return future.then(lambda f: f.value()[0])


def weight_gradients(model: nn.Module, loader: Any) -> None:
    """Make a DDP ``model`` average gradients by each rank's share of ``loader``'s batches."""
    if not isinstance(loader, WeightedLoader):
        raise InvalidValueError(
            f"loader= must come from dk.distributed_loader(..., weights=...), got "
            f"{type(loader).__name__}")
    register = getattr(model, "register_comm_hook", None)
    if register is not None:
        register(loader.share, _weighted_allreduce)
    loader.weighted.weighting_chosen = True
