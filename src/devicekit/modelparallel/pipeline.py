"""GPipe-style pipeline: a split model fed with micro-batches so its devices work at once.

The model is a chain of layers: an ``nn.Sequential``, or any module whose forward
``torch.fx`` traces, turned into a Sequential of stages by
:mod:`~devicekit.modelparallel.chain` (cut before each unit, or before the submodules named in
``stages=[...]``; values needed later pass through; the model's own parameters, nothing copied).
A Hugging Face transformers model, and a model whose forward does not trace but that holds a
block list (or is given ``stages=[...]``), is not traced: its own forward runs once per
micro-batch, cut at its blocks by hooks (:mod:`~devicekit.modelparallel.block_pipeline`), with
positional and keyword batches and ``ModelOutput`` results. Any other forward that does not
trace is refused with the reason in words and ``stages=[...]`` names that work, or ``dk.split``.
Like GPipe, the pipeline assumes samples are independent except in BatchNorm: for a traced model
with ``chunks > 1`` this is checked on ``sample`` (or the first batch), and an op that mixes
samples across the batch is refused by name (:mod:`~devicekit.modelparallel.per_sample`; an
output with the batch on dimension 1, an LSTM's ``h_n``, is joined on it). Building never changes
the model (:mod:`~devicekit.modelparallel.state_guard` puts back what profiling wrote), and with
``chunks > 1`` a buffer the forward writes other than BatchNorm's (a step counter) is refused by
name: per micro-batch it would be updated ``chunks`` times per batch.

Each batch is cut into ``chunks`` micro-batches; stage ``j`` runs micro-batch ``i`` in its own
worker thread as soon as stage ``j - 1`` has finished it (GPipe's clock order: at tick ``k``
stage ``j`` works on micro-batch ``k - j``), so while the second device works on the first
micro-batch the first device starts the second. The stage threads start with the first call and
serve every later one (:mod:`devicekit.modelparallel.worker`); :meth:`Pipeline.close` (or ``with
Pipeline(...) as pipe:``, or garbage collection) stops them, and a stage that raises leaves no
thread behind. With one micro-batch, or one stage, nothing can overlap and the parts run in the
calling thread, as :func:`~devicekit.modelparallel.split.split` does. Between CUDA devices
activations are copied on a side copy stream per device
(:mod:`devicekit.modelparallel.copy_streams`). Outputs are joined, so ``loss.backward()``
gives the same gradients as the unsplit model (models whose layers treat samples
independently; BatchNorm normalises per micro-batch, see below). Options:

* ``checkpoint``: ``"except_last"`` (default, as torchgpipe), ``"always"`` or ``"never"``:
  checkpointed micro-batches keep only their part's input and recompute the rest on backward.
  Only in training mode with grad enabled: in ``eval()`` or ``no_grad`` nothing is recomputed.
  Recomputation replays the random numbers the forward drew (dropout draws the same mask),
  which needs the forward's draws not to interleave with another stage's: stages that share a
  generator (CPU stages, two stages on one GPU) run one after another whenever a part draws
  random numbers (an ``nn.Dropout``, or anything that moves the generator, such as ``F.dropout``
  in a custom layer). A call that finds such a draw only after overlapping its stages discards
  its outputs and runs its forward again in order (once: the pipeline remembers).
* The pipeline stays where it was planned: ``.to(device)``/``.cuda()``/``.cpu()`` are refused
  (see :mod:`devicekit.modelparallel.stays`); dtype casts are fine.
* BatchNorm layers become :class:`~devicekit.modelparallel.batchnorm.DeferredBatchNorm` (same
  tensors): running statistics are updated once per mini-batch with the whole mini-batch's
  statistics, as a non-pipelined run would. ``deferred_batch_norm=False`` keeps plain BatchNorm.

On CPU (``["cpu", "cpu"]``) the forward passes overlap in threads; the backward pass runs in
torch's autograd engine, which runs CPU work on the calling thread (on GPUs it has one thread
per device). For processes and machines see :func:`devicekit.modelparallel.stages.pipeline_stage`.

Usage::

    import devicekit as dk

    pipe = dk.Pipeline(model, ["cuda:0", "cuda:1"], chunks=8, sample=batch)
    pipe = dk.Pipeline(resnet, ["cuda:0", "cuda:1"], chunks=8, stages=["conv1", "layer3"])
    pipe = dk.Pipeline(llama, ["cuda:0", "cuda:1"], chunks=4, sample={"input_ids": ids, "labels": ids})
    out = pipe(input_ids=ids, labels=ids)              # a CausalLMOutputWithPast; out.loss.backward()
    loss = loss_fn(pipe(batch), target.to(pipe.devices[-1]))
    loss.backward()
    print(pipe.plan)                  # the split
    print(pipe.last_run)              # measured idle fraction vs (n-1)/(m+n-1)
    pipe.close()                      # stop the stage threads (a later call restarts them)
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from devicekit.errors import InvalidValueError, SplitError
from devicekit.modelparallel.batchnorm import DeferredBatchNorm
from devicekit.modelparallel.block_pipeline import BlockPipeline
from devicekit.modelparallel.blocks import block_lists, suggest_stages
from devicekit.modelparallel.chain import Chain, to_chain
from devicekit.modelparallel.device_list import parse_devices
from devicekit.modelparallel.layer_plan import Balance, make_parts, resolve
from devicekit.modelparallel.microbatch import gather, move, scatter
from devicekit.modelparallel.module_units import is_plain_sequential
from devicekit.modelparallel.partition import Plan
from devicekit.modelparallel.per_sample import SampleCheck, check_per_sample
from devicekit.modelparallel.recompute import (
    CHECKPOINT_MODES,
    checkpoint_stop,
    checkpointed,
    drew_random_numbers,
    generator_states,
)
from devicekit.modelparallel.recompute import draws_random_numbers as _draws_random_numbers
from devicekit.modelparallel.recompute import shares_a_generator as _shares_a_generator
from devicekit.modelparallel.schedule import bubble_fraction
from devicekit.modelparallel.state_guard import StateGuard
from devicekit.modelparallel.stays import StaysOnPlan
from devicekit.modelparallel.trace import UntraceableError
from devicekit.modelparallel.worker import StageWorkers

__all__ = ["Pipeline", "PipelineRun"]


class PipelineCallError(InvalidValueError, TypeError):
    """A pipeline called with arguments its forward does not take (a TypeError, as Python's own)."""


def _devices_of(devices: Sequence[Any] | Plan) -> list[torch.device]:
    return devices.devices if isinstance(devices, Plan) else parse_devices(devices)


def _from_transformers(model: nn.Module) -> bool:
    """A Hugging Face model: keyword batches and ModelOutput results, run by hooks, never traced."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


def _watched(devices: Sequence[torch.device]) -> list[torch.device | None]:
    """Per stage, the CUDA device whose generator another stage shares (None: the CPU's only)."""
    return [d if d.type == "cuda" and devices.count(d) > 1 else None for d in devices]


def _refuse_repeated_batchnorm(layers: list[tuple[str, nn.Module]]) -> None:
    """A BatchNorm run twice per micro-batch cannot defer its running statistics to one update."""
    seen: dict[int, str] = {}
    for name, layer in layers:
        for sub in dict.fromkeys(layer.modules()):
            if isinstance(sub, DeferredBatchNorm):
                if id(sub) in seen:
                    raise SplitError(
                        f"BatchNorm in layer {seen[id(sub)]!r} runs again in layer {name!r} (a repeated "
                        "layer); deferred running statistics need one use per mini-batch: pass "
                        "deferred_batch_norm=False or give each use its own BatchNorm"
                    )
                seen[id(sub)] = name


def _refuse_written_buffers(name: str, chunks: int, written: Sequence[str]) -> None:
    """A buffer the forward writes (a step counter) would be written once per micro-batch."""
    if written:
        raise SplitError(
            f"cannot pipeline {name} with chunks={chunks}: buffer {written[0]!r} is written in its forward, so "
            f"run per micro-batch it would be updated {chunks} times per batch where the unsplit model updates "
            "it once; use chunks=1 or dk.split(model, devices) (BatchNorm running statistics are handled)")


@dataclass(frozen=True)
class PipelineRun:
    """Timing of the last forward: wall time and per-stage busy time."""

    microbatches: int
    stages: int
    wall_seconds: float
    busy_seconds: tuple[float, ...]

    @property
    def idle_fraction(self) -> float:
        """Share of stage-time spent waiting: 1 - sum(busy) / (stages * wall)."""
        if self.wall_seconds <= 0:
            return 0.0
        return max(0.0, 1.0 - sum(self.busy_seconds) / (self.stages * self.wall_seconds))

    @property
    def predicted_idle_fraction(self) -> float:
        return bubble_fraction(self.microbatches, self.stages)

    def __str__(self) -> str:
        return (f"{self.microbatches} micro-batch(es) x {self.stages} stage(s): "
                f"{self.wall_seconds * 1e3:.1f} ms, idle {self.idle_fraction:.1%} "
                f"(schedule predicts {self.predicted_idle_fraction:.1%} for equal stages)")


class Pipeline(StaysOnPlan):
    """A model split over ``devices`` as a chain of stages and run on micro-batches (see module doc).

    ``stages``: names of submodules to cut before (any module); without it an ``nn.Sequential``
    is cut between its layers and any other module before each of its units."""

    split_again = "dk.Pipeline(pipe.module, [...])"

    def __init__(
        self,
        model: nn.Module,
        devices: Sequence[Any] | Plan,
        *,
        chunks: int,
        balance: Balance = "size",
        sample: Any = None,
        optimizer: str | float | None = "adam",
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = True,
        stages: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise InvalidValueError(f"chunks {chunks!r} must be a positive int (micro-batches per batch)")
        if checkpoint not in CHECKPOINT_MODES:
            raise InvalidValueError(f"checkpoint {checkpoint!r} is unknown; use one of {', '.join(CHECKPOINT_MODES)}")
        if deferred_batch_norm and chunks > 1:  # in the model itself, so model.eval() reaches them
            model = DeferredBatchNorm.convert(model)
        chain: Chain | None = None
        found: SampleCheck | None = None
        self._blocks: BlockPipeline | None = None
        if stages is not None or not (is_plain_sequential(model) or isinstance(model, nn.ModuleList)):
            if not _from_transformers(model):
                try:
                    chain = to_chain(model, stages)  # the same modules and parameters, as a Sequential of stages
                except UntraceableError as exc:  # run by hooks when cut points are known
                    if stages is None and not block_lists(model):
                        reason = str(exc).split("; pass stages")[0]
                        raise SplitError(f"{reason}; {suggest_stages(model, _devices_of(devices), sample)}") from None
            if chain is None:  # its forward runs as it is, cut at module boundaries (block_pipeline)
                self._build_blocks(model, devices, chunks, balance, sample, optimizer, stages, checkpoint)
                return
            if chunks > 1 and sample is not None:
                found = check_per_sample(chain, sample)
        with StateGuard(model) as guard:  # building leaves every buffer as it was
            layers, plan = resolve(model if chain is None else chain, devices, balance, sample, optimizer)
        if chunks > 1:
            _refuse_written_buffers(type(model).__name__, chunks, [*(found.written if found else ()), *guard.written])
        if deferred_batch_norm and chunks > 1:
            _refuse_repeated_batchnorm(layers)
        DeferredBatchNorm.commit_all(model, discard=True)  # forget what profiling tracked
        parts = make_parts(layers, plan)
        self.module = model
        # the traced chain (not a registered submodule: state_dict keys stay "module.*"), whose
        # per-sample check runs on the first batch when no sample was given
        self._chains = [] if chain is None else [chain]
        self._unchecked = chunks > 1 and sample is None
        # per output tensor, the dimension that holds the batch (an LSTM's h_n: 1); None: all 0
        self._output_dims = found.output_dims if found is not None else None
        self._parts = parts
        self.plan = plan
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.last_run: PipelineRun | None = None
        # the parts' DeferredBatchNorm layers, found once rather than by walking the model every call
        self._deferred = [m for part in parts for m in part.modules() if isinstance(m, DeferredBatchNorm)]
        self._workers: StageWorkers | None = None  # stage threads, started by the first pipelined call
        # layers that draw random numbers (dropout & co.), found once: see _random_draws_race
        self._random = [m for part in parts for m in part.modules() if _draws_random_numbers(m)]
        self._shared_generator = _shares_a_generator(plan.devices)
        self._watch = _watched(plan.devices)
        self._draws_random = False  # a part was seen drawing from a generator stages share

    def _build_blocks(self, model: nn.Module, devices: Sequence[Any] | Plan, chunks: int, balance: Balance,
                      sample: Any, optimizer: str | float | None, stages: Sequence[str] | None,
                      checkpoint: str) -> None:
        """A model that does not trace (or one from transformers): its own forward, pipelined by hooks."""
        if isinstance(devices, Plan):
            parse_devices(devices.devices)  # a plan made for GPUs this process cannot see is refused here
        engine = BlockPipeline(model, devices if isinstance(devices, Plan) else parse_devices(devices),
                               chunks=chunks, balance=balance, sample=sample, optimizer=optimizer, stages=stages)
        DeferredBatchNorm.commit_all(model, discard=True)  # forget what profiling tracked
        self._blocks = engine
        self.module = model
        self.plan = engine.plan
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.last_run = None
        self._parts = [nn.Sequential(OrderedDict((n.replace(".", "_"), model.get_submodule(n))
                                                 for n in (*p.layer_names, *p.tied_names))) for p in engine.plan.parts]
        self._deferred = [m for m in model.modules() if isinstance(m, DeferredBatchNorm)]
        self._workers = None
        if chunks > 1:
            _refuse_repeated_batchnorm([(n, model.get_submodule(n)) for p in engine.plan.parts for n in p.layer_names])

    def _forward_blocks(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        assert self._blocks is not None
        start = time.perf_counter()
        try:
            out, m, busy = self._blocks(args, kwargs, chunks=self.chunks, checkpoint=self.checkpoint,
                                        training=self.training)
        except BaseException:
            for bn in self._deferred:
                bn.discard()
            raise
        if self.training:
            for bn in self._deferred:
                bn.commit()
        self.last_run = PipelineRun(m, len(self.plan.parts), time.perf_counter() - start, tuple(busy))
        return out

    @property
    def parts(self) -> list[nn.Sequential]:
        """Per device, the layers it runs (views: with ``stages`` or a model run by hooks, call the
        pipeline itself, since its forward joins the parts)."""
        return list(self._parts)

    @property
    def devices(self) -> list[torch.device]:
        return self.plan.devices

    def _run_part(self, stage: int, x: Any, recompute: bool) -> Any:
        part = self._parts[stage]
        if not recompute:
            return part(x)
        return checkpointed(part, x, name=f"part {stage} (layers {self.plan.parts[stage].layer_range})")

    def _inline(self, batches: list[Any], stop: int) -> tuple[list[Any], list[float]]:
        """One micro-batch or one stage: nothing can overlap, so run the parts in this thread."""
        busy = [0.0] * len(self._parts)
        outputs = []
        for i, x in enumerate(batches):
            for j, device in enumerate(self.plan.devices):
                start = time.perf_counter()
                x = self._run_part(j, move(x, device), i < stop)
                busy[j] += time.perf_counter() - start
            outputs.append(x)
        return outputs, busy

    def _random_draws_race(self, stop: int) -> bool:
        """True when stage threads would corrupt checkpointing's replay of random draws.

        A checkpointed micro-batch saves the RNG state and replays it on backward, so dropout
        draws the same mask twice; but stages sharing a generator (CPU stages, or two stages
        on one GPU) would draw from it concurrently, so the forward's mask would not be the one
        the saved state replays. Known random layers in training mode, or a part seen drawing
        before (:meth:`_overlapped` watches the generators), make such calls run in this thread.
        """
        if stop == 0:
            return False
        return self._draws_random or (self._shared_generator and any(m.training for m in self._random))

    def _overlapped(self, batches: list[Any], stop: int) -> tuple[list[Any], list[float]] | None:
        """Run the stages in their threads; None if a part drew random numbers that replay needs."""
        if self._workers is None:
            self._workers = StageWorkers(self.plan.devices)
        drew: list[int] = []

        def task(stage: int, index: int, value: Any) -> Any:
            if stop == 0:
                return self._run_part(stage, value, False)
            before = generator_states(self._watch[stage])
            out = self._run_part(stage, value, index < stop)
            if drew_random_numbers(before, generator_states(self._watch[stage])):
                drew.append(stage)
            return out

        outputs, busy = self._workers.run(task, batches)
        if drew:  # the draws may have interleaved: these outputs' replay would use other masks
            self._draws_random = True
            for bn in self._deferred:
                bn.discard()
            return None
        return outputs, busy

    def _written_by_forward(self, x: Any) -> list[str]:
        """Buffers (BatchNorm's aside) one micro-batch writes, run without grad; put back after."""
        if not any(b is not None for m in self.module.modules() if not isinstance(m, _BatchNorm)
                   for b in m._buffers.values()):
            return []  # no buffer to write: nothing to run
        first = scatter(x, self.chunks)[0]
        try:
            with StateGuard(self.module) as guard, torch.no_grad():
                for j, device in enumerate(self.plan.devices):
                    first = self._parts[j](move(first, device))
        finally:
            for bn in self._deferred:
                bn.discard()
        return guard.written

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._blocks is not None:
            return self._forward_blocks(args, kwargs)
        if kwargs or len(args) != 1:
            raise PipelineCallError(
                f"this pipeline runs {type(self.module).__name__}'s traced forward, which takes one batch; call "
                "pipe(batch) (a tuple or dict of tensors is one batch)")
        x = args[0]
        if self._unchecked:  # once: a model that mixes samples or writes buffers is refused
            if self._chains:
                found = check_per_sample(self._chains[0], x)
                written = list(found.written)
                self._output_dims = found.output_dims
            else:
                written = self._written_by_forward(x)
            _refuse_written_buffers(type(self.module).__name__, self.chunks, written)
            self._unchecked = False
        batches = scatter(x, self.chunks)
        m, n = len(batches), len(self._parts)
        # checkpointing only pays when training: in eval() or no_grad nothing is recomputed
        stop = checkpoint_stop(self.checkpoint, m) if torch.is_grad_enabled() and self.training else 0
        start = time.perf_counter()
        try:
            done = None
            if not (m == 1 or n == 1 or self._random_draws_race(stop)):
                done = self._overlapped(batches, stop)
            outputs, busy = done if done is not None else self._inline(batches, stop)
        except BaseException:
            for bn in self._deferred:
                bn.discard()
            raise
        if self.training:
            for bn in self._deferred:
                bn.commit()
        self.last_run = PipelineRun(m, n, time.perf_counter() - start, tuple(busy))
        return gather(outputs, self._output_dims)

    def close(self) -> None:
        """Stop the stage threads now (they also stop when the pipeline is garbage-collected).

        A later call starts new ones, so closing is always safe."""
        if self._workers is not None:
            self._workers.close()
        if self._blocks is not None:
            self._blocks.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:  # copy.deepcopy / pickle: threads stay behind
        state = super().__getstate__()
        state["_workers"] = None
        return state

    def extra_repr(self) -> str:
        return (f"devices={[str(d) for d in self.devices]}, counts={self.plan.counts}, "
                f"chunks={self.chunks}, checkpoint={self.checkpoint!r}")
