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

Two engines sit behind this one front door, each a small class with the same call: the chain
engine (:mod:`~devicekit.modelparallel.chain_pipeline`: a Sequential or a traced model, cut into
one part per device) and the hook engine (:mod:`~devicekit.modelparallel.block_pipeline`: the
model's own forward, cut at its blocks). Both cut each batch into ``chunks`` micro-batches and run
micro-batch ``i`` in thread ``i`` of one micro-batch pool
(:mod:`~devicekit.modelparallel.microbatch_threads`): it enters stage ``j`` once micro-batch
``i - 1`` has left it (GPipe's clock order: at tick ``k`` stage ``j`` works on micro-batch
``k - j``), so while the second device works on the first micro-batch the first device starts
the second. The threads start with the first pipelined call and serve every later one;
:meth:`Pipeline.close` (or ``with Pipeline(...) as pipe:``, or garbage collection) stops them,
and a call that raises leaves no thread behind. With one micro-batch, or one stage, nothing can
overlap and the parts run in the calling thread, as :func:`~devicekit.modelparallel.split.split`
does; so does the first call that records gradients (it counts each micro-batch's autograd
nodes, which keeps backward's sums in the unsplit order). Between CUDA devices activations are
copied on a side copy stream per device (:mod:`devicekit.modelparallel.copy_streams`). Outputs
are joined, so ``loss.backward()`` gives the same gradients as the unsplit model (models whose
layers treat samples independently; BatchNorm normalises per micro-batch, see below). Options:

* ``checkpoint``: ``"except_last"`` (default, as torchgpipe), ``"always"`` or ``"never"``:
  checkpointed micro-batches keep only their part's input and recompute the rest on backward.
  Only in training mode with grad enabled: in ``eval()`` or ``no_grad`` nothing is recomputed.
  Recomputation replays the random numbers the forward drew (dropout draws the same mask).
* Random numbers: stages that share a generator (CPU stages, two stages on one GPU) run their
  micro-batches one after another whenever a part draws random numbers (an ``nn.Dropout``, or
  anything that moves the generator, such as ``F.dropout`` in a custom layer), with every
  ``checkpoint`` mode: overlapped, the draws would interleave in an order that changes from call
  to call. So the same seed gives the same outputs every call, and the same as the default
  ``checkpoint``. A call that finds such a draw only after overlapping discards its outputs and
  runs again in order (once: the pipeline remembers).
* Losses: a scalar output (a transformers ``loss``, a plain model's own mean loss) is joined to
  the whole batch's: weighted by label tokens where the batch has ``labels`` (checked on the
  sample), else by micro-batch sizes (:mod:`~devicekit.modelparallel.output_join`). Where the
  whole batch's value cannot be had (a MoE's load-balancing ``aux_loss``; dropout masks drawn
  per micro-batch) a :class:`PipelineDiffers` warning says so once.
* The pipeline stays where it was planned: ``.to(device)``/``.cuda()``/``.cpu()`` are refused
  (see :mod:`devicekit.modelparallel.stays`); dtype casts are fine.
* BatchNorm layers become :class:`~devicekit.modelparallel.batchnorm.DeferredBatchNorm` (same
  tensors): running statistics are updated once per mini-batch, as one update over all the
  micro-batches' inputs to the layer together would (past the first BatchNorm those inputs come
  from layers normalised per micro-batch, so they are not an unsplit run's).
  ``deferred_batch_norm=False`` keeps plain BatchNorm.

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
    pipe.close()                      # stop the micro-batch threads (a later call restarts them)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from devicekit.errors import InvalidValueError, SplitError
from devicekit.modelparallel.batchnorm import DeferredBatchNorm
from devicekit.modelparallel.block_pipeline import BlockPipeline
from devicekit.modelparallel.blocks import block_lists, suggest_stages
from devicekit.modelparallel.chain import Chain, to_chain
from devicekit.modelparallel.chain_pipeline import ChainPipeline, PipelineCallError
from devicekit.modelparallel.device_list import parse_devices
from devicekit.modelparallel.layer_plan import Balance
from devicekit.modelparallel.module_units import is_plain_sequential
from devicekit.modelparallel.partition import Plan
from devicekit.modelparallel.recompute import CHECKPOINT_MODES, PipelineDiffers
from devicekit.modelparallel.schedule import bubble_fraction
from devicekit.modelparallel.stays import StaysOnPlan
from devicekit.modelparallel.trace import UntraceableError

__all__ = ["Pipeline", "PipelineRun", "PipelineCallError", "PipelineDiffers"]

Engine = ChainPipeline | BlockPipeline


def _devices_of(devices: Sequence[Any] | Plan) -> list[torch.device]:
    return parse_devices(devices.devices) if isinstance(devices, Plan) else parse_devices(devices)


def _from_transformers(model: nn.Module) -> bool:
    """A Hugging Face model: keyword batches and ModelOutput results, run by hooks, never traced."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


def _engine(model: nn.Module, devices: Sequence[Any] | Plan, chunks: int, balance: Balance, sample: Any,
            optimizer: str | float | None, stages: Sequence[str] | None) -> Engine:
    """The chain engine for a Sequential or a forward that traces; the hook engine otherwise."""
    chain: Chain | None = None
    if stages is not None or not (is_plain_sequential(model) or isinstance(model, nn.ModuleList)):
        if not _from_transformers(model):
            try:
                chain = to_chain(model, stages)  # the same modules and parameters, as a Sequential of stages
            except UntraceableError as exc:  # run by hooks when cut points are known
                if stages is None and not block_lists(model):
                    reason = str(exc).split("; pass stages")[0]
                    raise SplitError(f"{reason}; {suggest_stages(model, _devices_of(devices), sample)}") from None
        if chain is None:  # its forward runs as it is, cut at module boundaries
            where = devices if isinstance(devices, Plan) else parse_devices(devices)
            _devices_of(where)  # a plan made for GPUs this process cannot see is refused here
            return BlockPipeline(model, where, chunks=chunks, balance=balance, sample=sample, optimizer=optimizer,
                                 stages=stages)
    return ChainPipeline(model, chain, devices, chunks=chunks, balance=balance, sample=sample, optimizer=optimizer)


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
        engine = _engine(model, devices, chunks, balance, sample, optimizer, stages)
        if deferred_batch_norm and chunks > 1:
            _refuse_repeated_batchnorm(engine.layers)
        DeferredBatchNorm.commit_all(model, discard=True)  # forget what profiling tracked
        self.module = model  # the only registered submodule: state_dict keys stay "module.*"
        self.plan: Plan = engine.plan
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.last_run: PipelineRun | None = None
        self._engine = engine
        self._deferred = [m for m in model.modules() if isinstance(m, DeferredBatchNorm)]

    @property
    def parts(self) -> list[nn.Sequential]:
        """Per device, the layers it runs (views: with ``stages`` or a model run by hooks, call the
        pipeline itself, since its forward joins the parts)."""
        return list(self._engine.parts)

    @property
    def devices(self) -> list[torch.device]:
        return self.plan.devices

    def _discard(self) -> None:
        for bn in self._deferred:
            bn.discard()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            out, m, busy = self._engine(args, kwargs, chunks=self.chunks, checkpoint=self.checkpoint,
                                        training=self.training, discard=self._discard)
        except BaseException:
            self._discard()
            raise
        if self.training:
            for bn in self._deferred:
                bn.commit()
        self.last_run = PipelineRun(m, len(self.plan.parts), time.perf_counter() - start, tuple(busy))
        return out

    def close(self) -> None:
        """Stop the micro-batch threads now (they also stop when the pipeline is garbage-collected).

        A later call starts new ones, so closing is always safe."""
        self._engine.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def extra_repr(self) -> str:
        return (f"devices={[str(d) for d in self.devices]}, counts={self.plan.counts}, "
                f"chunks={self.chunks}, checkpoint={self.checkpoint!r}")
