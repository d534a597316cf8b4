"""Grow a pipeline past one machine: the same plan drives ``torch.distributed.pipelining``.

Every process builds the same model and calls :func:`pipeline_stage`; process ``rank`` of the
group keeps part ``rank`` of the plan on its own ``device`` and wraps it in torch's
``PipelineStage``; the returned object's ``step`` runs torch's ``ScheduleGPipe`` (fill/drain,
as :class:`~devicekit.modelparallel.pipeline.Pipeline` does in one process). The plan is computed
on the group's first rank and broadcast, so all ranks cut the model identically even when
``balance="time"`` measures differently per machine. Activations and gradients travel over the
process group (gloo on CPU, NCCL on GPUs). Launch the processes with ``torchrun`` or ``dk.launch``.

Usage (one process per stage, ``torchrun --nproc-per-node 2 train.py``)::

    import torch.distributed as dist
    import devicekit as dk

    dist.init_process_group("gloo")
    stage = dk.pipeline_stage(model, "cpu", chunks=4, sample=batch, loss_fn=nn.MSELoss())
    if stage.is_first:
        stage.step(inputs)                    # sends activations on
    elif stage.is_last:
        losses = []
        stage.step(target=targets, losses=losses)
    else:
        stage.step()
    optimizer.step()                          # each rank updates its own part
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from devicekit.errors import DeviceKitError, DistributedError
from devicekit.modelparallel.batchnorm import DeferredBatchNorm
from devicekit.modelparallel.device_list import parse_device
from devicekit.modelparallel.partition import Plan
from devicekit.modelparallel.split import Balance, make_parts, resolve

__all__ = ["pipeline_stage", "DistributedStage"]


@dataclass
class DistributedStage:
    """This process's part of a multi-process pipeline and the GPipe schedule that runs it."""

    part: nn.Sequential
    plan: Plan
    index: int
    stage: Any  # torch.distributed.pipelining.PipelineStage
    schedule: Any  # torch.distributed.pipelining.ScheduleGPipe

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == len(self.plan.parts) - 1

    def parameters(self) -> Any:
        """This stage's parameters (give them to this rank's optimizer)."""
        return self.part.parameters()

    def step(self, *args: Any, target: Any = None, losses: list[Any] | None = None) -> Any:
        """One mini-batch through the whole pipeline; the last stage returns the joined output."""
        kwargs: dict[str, Any] = {}
        if target is not None:
            kwargs["target"] = target
        if losses is not None:
            kwargs["losses"] = losses
        try:
            out = self.schedule.step(*args, **kwargs)
        except BaseException:
            DeferredBatchNorm.commit_all(self.part, discard=True)
            raise
        if self.part.training:
            DeferredBatchNorm.commit_all(self.part)
        return out


def pipeline_stage(
    model: nn.Module,
    device: Any,
    *,
    chunks: int,
    balance: Balance = "size",
    sample: Any = None,
    optimizer: str | float | None = "adam",
    loss_fn: Callable[..., torch.Tensor] | None = None,
    group: Any = None,
    scale_grads: bool = True,
) -> DistributedStage:
    """This process's stage of a pipeline over the ranks of ``group`` (the default group if None).

    ``device``: where this rank's part runs (e.g. ``"cpu"`` or ``f"cuda:{local_rank}"``).
    ``balance``/``sample``/``optimizer``: as :func:`devicekit.split`; ``chunks``: micro-batches
    per step; ``loss_fn(output, target)``: applied per micro-batch on the last stage;
    ``scale_grads``: divide gradients by ``chunks`` (mean over micro-batches, torch's default).
    """
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    if not dist.is_available() or not dist.is_initialized():
        raise DistributedError(
            "pipeline_stage needs an initialised process group; call torch.distributed.init_process_group first"
        )
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise DistributedError(f"chunks {chunks!r} must be a positive int (micro-batches per step)")
    if chunks > 1:  # running statistics once per mini-batch; in the model, so eval() reaches them
        model = DeferredBatchNorm.convert(model)
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    local = parse_device(device)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    if isinstance(balance, str):  # measure once, on the first rank, and share the counts
        box: list[Any] = [None]
        if rank == 0:
            try:
                box[0] = resolve(model, [local] * world, balance, sample, optimizer, separate=True)[1].counts
            except DeviceKitError as exc:  # every rank must hear of it, or the others wait forever
                box[0] = exc
        dist.broadcast_object_list(box, src=src, group=group)
        if isinstance(box[0], DeviceKitError):
            raise box[0]
        balance = box[0]
    layers, plan = resolve(model, [local] * world, balance, sample, optimizer, separate=True)
    own = Plan(parts=list(plan.parts), basis=plan.basis, memory_basis=plan.memory_basis,
               reasons=plan.reasons + [f"rank {rank} of {world} runs part {rank}"])
    part_plan = Plan(parts=[plan.parts[rank]], basis=plan.basis)
    DeferredBatchNorm.commit_all(model, discard=True)  # forget what profiling tracked
    part = make_parts(layers, part_plan)[0]
    stage = PipelineStage(part, rank, world, local, group=group)
    schedule = ScheduleGPipe(stage, chunks, loss_fn=loss_fn, scale_grads=scale_grads)
    return DistributedStage(part=part, plan=own, index=rank, stage=stage, schedule=schedule)
