"""Pipeline a model's own forward at module boundaries: hooks place it, threads overlap micro-batches.

What ``dk.Pipeline`` runs for models it does not trace (every Hugging Face model, and any model
whose forward ``torch.fx`` cannot trace): nothing of the forward is rewritten. The model is
placed as ``dk.split`` places it (:class:`~devicekit.modelparallel.module_split.ModuleSplit`:
each unit on its device, hooks move inputs, parent code may mix devices), with stage boundaries
at its blocks (:mod:`~devicekit.modelparallel.blocks`). A call cuts the batch (positional and
keyword arguments: ``input_ids``, ``attention_mask``, ``labels``, ``pixel_values``) into
micro-batches along dimension 0 and runs the model's forward once per micro-batch, each in its
own thread (:mod:`~devicekit.modelparallel.microbatch_threads`). A forward pre-hook on the module that begins stage ``k`` is a turnstile: micro-batch
``i`` enters stage ``k`` only after micro-batch ``i - 1`` has left it, and leaving stage ``k - 1``
lets micro-batch ``i + 1`` in: GPipe's order (at any moment each stage holds one micro-batch,
the first device starts micro-batch 2 while the second works on micro-batch 1). Outputs are
joined by :mod:`~devicekit.modelparallel.output_join` (``logits`` concatenated, ``loss`` the
size-weighted mean of the micro-batches' losses).

* Recompute: with ``checkpoint`` on, each block call of a checkpointed micro-batch keeps only
  its inputs and is recomputed on backward (per block, as Hugging Face's gradient checkpointing
  does; :func:`~devicekit.modelparallel.recompute.checkpointed_call`).
* Random draws: see :mod:`~devicekit.modelparallel.microbatch_threads` (while dropout is active
  on stages that share a generator, micro-batches run one after another: the same draws every call).
* With ``chunks > 1``, on the sample (or the first batch) the model runs whole, in halves and a
  half doubled (eval, no grad, buffers put back): an output that mixes samples, a scalar that is
  neither a mean nor a sum, a buffer the forward writes (other than BatchNorm's), or a stage
  module not called once each, in order, is refused by name.
* Caches: a forward with a ``use_cache`` argument is called with ``use_cache=False`` (one cache
  per micro-batch could not be joined); ``use_cache=True`` with ``chunks > 1`` is refused.

Usage (``dk.Pipeline`` builds this for such models; call the pipeline, not the engine)::

    engine = BlockPipeline(llama, devices, chunks=2, balance="size", optimizer="adam", stages=None,
                           sample={"input_ids": ids, "labels": ids})
    out, microbatches, busy = engine((), {"input_ids": ids, "labels": ids}, chunks=2,
                                     checkpoint="except_last", training=True, discard=lambda: None)
    out.loss.backward()
    engine.close()                     # the micro-batch threads
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from devicekit.errors import InvalidValueError, SplitError
from devicekit.modelparallel.batchnorm import DeferredBatchNorm
from devicekit.modelparallel.blocks import plan_blocks
from devicekit.modelparallel.call_args import as_call
from devicekit.modelparallel.microbatch import batch_leaves, move, padded, scatter
from devicekit.modelparallel.microbatch_threads import MicroBatchRunner, Stages, records_grad
from devicekit.modelparallel.module_split import ModuleSplit
from devicekit.modelparallel.output_join import (
    WEIGHTED,
    Join,
    join,
    label_counts,
    learn_join,
    warn_uneven,
)
from devicekit.modelparallel.partition import Plan
from devicekit.modelparallel.recompute import (
    checkpoint_stop,
    checkpointed_call,
    draws_random_numbers,
)
from devicekit.modelparallel.state_guard import StateGuard, refuse_written_buffers

__all__ = ["BlockPipeline"]

_ctx = threading.local()  # the micro-batch this thread runs: .run (its Stages), .index, .recompute


class BlockPipeline:
    """The pipeline engine for a model cut at module boundaries (see the module doc)."""

    def __init__(self, model: nn.Module, devices: list[torch.device] | Plan, *, chunks: int,
                 balance: str | Sequence[int], sample: Any, optimizer: str | float | None,
                 stages: Sequence[str] | None) -> None:
        if isinstance(devices, Plan):  # a plan's parts begin where its stages do
            stages = [p.layer_names[0] for p in devices.parts[1:]] if stages is None else stages
            devices = devices.devices
        with StateGuard(model):
            staged = plan_blocks(model, list(devices), balance=balance, sample=sample, optimizer=optimizer,
                                 stages=stages)
        self.plan = staged.plan
        self.name = type(model).__name__
        self.cuts = staged.cuts
        self._keywords = _parameters(model)
        self._model = model
        self.split: ModuleSplit | None = None
        self.how: Join | None = None
        self.unchecked = chunks > 1
        if chunks > 1 and sample is not None:  # before anything is placed: a refusal leaves the model as it was
            self.check(as_call(model, sample), chunks)
        self.split = ModuleSplit(model, staged.plan)
        self._handles = [model.get_submodule(cut).register_forward_pre_hook(self._enter(k + 1))
                         for k, cut in enumerate(staged.cuts)]
        wrapped = staged.blocks or tuple(n for p in staged.plan.parts for n in p.layer_names)
        for name in wrapped:
            _recompute_calls(model.get_submodule(name), name)
        self._random = [m for m in model.modules() if draws_random_numbers(m)]
        self._runner = MicroBatchRunner(self.plan.devices)

    @staticmethod
    def _enter(stage: int) -> Any:
        def pre(module: nn.Module, args: Any) -> None:
            run = getattr(_ctx, "run", None)
            if run is None:
                return  # not a pipelined call (a check, or recomputation during backward)
            current = run.at(_ctx.index)
            if stage <= current and run.ordered:
                raise SplitError(f"stage {stage}'s first module ran again after stage {current} began; a "
                                 "pipeline needs its stage modules called once each, in order: use chunks=1")
            run.enter(_ctx.index, stage)
        return pre

    @property
    def model(self) -> nn.Module:
        return self._model

    def _run_whole(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The model on one batch: placed (the split) or, before placing, where it is."""
        if self.split is not None:
            return self.split(*args, **kwargs)
        where = next((t.device for t in self._model.parameters()), torch.device("cpu"))
        args, kwargs = move((args, kwargs), where)
        return self._model(*args, **kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any], chunks: int) -> tuple[Any, dict[str, Any]]:
        if "use_cache" in self._keywords and "use_cache" not in kwargs:
            kwargs = {**kwargs, "use_cache": False}
        elif kwargs.get("use_cache") and chunks > 1:
            raise InvalidValueError("use_cache=True: a pipeline would return one cache per micro-batch; pass "
                                    "use_cache=False for training, or use chunks=1 (or dk.split) to generate")
        return args, kwargs

    def check(self, call: tuple[tuple[Any, ...], dict[str, Any]], chunks: int) -> None:
        """Learn how to join outputs; refuse what micro-batches would change (see the module doc)."""
        args, kwargs = self._call(*call, chunks)
        model = self.model
        batch, shared = _batch_part(kwargs)
        modes = {m: m.training for m in model.modules()}
        order: list[int] = []

        def run(part: Any) -> Any:
            return self._run_whole(part[0], {**part[1], **shared})

        try:
            with StateGuard(model) as guard, torch.no_grad():
                model.train()  # what the forward writes when training (a step counter, an EMA)
                first = scatter((args, batch), 2)[0]
                run(first)
                model.eval()
                handles = [model.get_submodule(cut).register_forward_pre_hook(
                    lambda *_, k=k: order.append(k)) for k, cut in enumerate(self.cuts, start=1)]
                try:
                    run((args, batch))
                finally:
                    for handle in handles:
                        handle.remove()
                how, uneven = learn_join(run, (args, batch), self.name, chunks)
        finally:
            for m, mode in modes.items():
                m.training = mode
                if isinstance(m, DeferredBatchNorm):
                    m.discard()
        refuse_written_buffers(self.name, chunks, guard.written)
        want = list(range(1, len(self.cuts) + 1))
        if order != want:
            raise SplitError(
                f"cannot pipeline {self.name} with chunks={chunks}: the modules that begin its stages "
                f"({', '.join(self.cuts)}) ran as stages {order} on the sample, not once each in order {want}; "
                "use chunks=1 or dk.split(model, devices)")
        self.how = how
        self.unchecked = False
        warn_uneven(self.name, chunks, uneven)

    @property
    def parts(self) -> list[nn.Sequential]:
        """Per device, views of the modules it holds (the model's own forward joins them)."""
        model = self._model
        return [nn.Sequential(OrderedDict((n.replace(".", "_"), model.get_submodule(n))
                                          for n in (*p.layer_names, *p.tied_names))) for p in self.plan.parts]

    @property
    def layers(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of each stage's layers, in order."""
        return [(n, self._model.get_submodule(n)) for p in self.plan.parts for n in p.layer_names]

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, chunks: int, checkpoint: str,
                 training: bool, discard: Any) -> tuple[Any, int, list[float]]:
        """The joined output, the number of micro-batches and per-stage busy seconds."""
        args, kwargs = self._call(args, kwargs, chunks)
        if self.unchecked:
            self.check((args, kwargs), chunks)
        batch, shared = _batch_part(kwargs)
        calls = scatter((args, batch), chunks) if chunks > 1 else [(args, batch)]
        sizes = [padded(batch_leaves(c)[0]).size(0) if batch_leaves(c) else 1 for c in calls]
        stop = checkpoint_stop(checkpoint, len(calls)) if torch.is_grad_enabled() and training else 0

        def body(i: int, stages: Stages) -> Any:
            _ctx.run, _ctx.index, _ctx.recompute = stages, i, i < stop
            try:
                return self._run_whole(calls[i][0], {**calls[i][1], **shared})
            finally:
                _ctx.run, _ctx.recompute = None, False

        outputs, busy = self._runner.run(len(calls), body, random_active=any(m.training for m in self._random),
                                         records_grad=records_grad(self._model, calls), discard=discard)
        how = self.how
        if how is not None and "num_items_in_batch" in shared:  # each loss is a sum / the batch's count
            how = tuple("sum" if h in WEIGHTED else h for h in how)
        found = [label_counts(c) for c in calls]
        counts = {k: [c[k] for c in found if c is not None] for k in ("tokens", "shifted")} \
            if all(c is not None for c in found) else None
        return join(outputs, sizes, how, counts), len(calls), busy

    def close(self) -> None:
        """Stop the micro-batch threads (a later call starts new ones)."""
        self._runner.close()


def _batch_part(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword arguments cut into micro-batches, and those every micro-batch shares (a 0-d count)."""
    shared = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() == 0}
    shared.update({k: v for k, v in kwargs.items() if k == "num_items_in_batch"})
    return {k: v for k, v in kwargs.items() if k not in shared}, shared


def _parameters(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _recompute_calls(block: nn.Module, name: str) -> None:
    """Make ``block``'s calls checkpointed when this thread's micro-batch is (an instance ``forward``:
    a partial of a module-level function, so ``copy.deepcopy`` and pickle take the copy's block)."""
    block.forward = functools.partial(_block_forward, block, name, block.__dict__.get("forward"))


def _block_forward(block: nn.Module, name: str, previous: Any, *args: Any, **kwargs: Any) -> Any:
    forward = previous if previous is not None else functools.partial(type(block).forward, block)
    if getattr(_ctx, "recompute", False) and torch.is_grad_enabled():
        return checkpointed_call(lambda call: forward(*call[0], **call[1]), (args, kwargs), name=f"block {name!r}")
    return forward(*args, **kwargs)
