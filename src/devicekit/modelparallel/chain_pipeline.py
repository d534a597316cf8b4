"""Pipeline a chain of parts: an ``nn.Sequential``, or a traced model's Sequential of stages.

What ``dk.Pipeline`` runs for models that are a chain (an ``nn.Sequential``, a ``ModuleList``,
or a forward that ``torch.fx`` traces, turned into stages by :mod:`~devicekit.modelparallel.chain`).
The layers are balanced over the devices (:mod:`~devicekit.modelparallel.layer_plan`) into one
``nn.Sequential`` part per device. A call takes one batch (a tensor, or a tuple or dict of
them), cuts it into micro-batches along dimension 0 (:mod:`~devicekit.modelparallel.microbatch`)
and runs micro-batch ``i`` through the parts in thread ``i``, entering part ``j`` after
micro-batch ``i - 1`` left it (:class:`~devicekit.modelparallel.microbatch_threads.MicroBatchRunner`).
Between CUDA devices activations move on side copy streams
(:mod:`~devicekit.modelparallel.copy_streams`). Outputs are joined as the hook engine joins
them (:mod:`~devicekit.modelparallel.output_join`): concatenated (an output with the batch on
dimension 1, an LSTM's ``h_n``, on it), and a loss the model computes itself as the
size-weighted mean (or the sum) of the micro-batches' values.

* Recompute: a checkpointed micro-batch keeps each part's input only and recomputes the part on
  backward (:func:`~devicekit.modelparallel.recompute.checkpointed`, as torchgpipe does).
* With ``chunks > 1`` the traced chain is checked on the sample (or the first batch): an op that
  mixes samples, or a buffer the forward writes other than BatchNorm's, is refused by name
  (:mod:`~devicekit.modelparallel.per_sample`).

Usage (``dk.Pipeline`` builds this; call the pipeline, not the engine)::

    engine = ChainPipeline(model, None, devices, chunks=4, balance="size", sample=x, optimizer="adam")
    out, microbatches, busy = engine((x,), {}, chunks=4, checkpoint="except_last", training=True,
                                     discard=lambda: None)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from devicekit.errors import InvalidValueError
from devicekit.modelparallel.chain import Chain
from devicekit.modelparallel.copy_streams import CopyStreams, mark, tensors_in
from devicekit.modelparallel.layer_plan import Balance, make_parts, resolve
from devicekit.modelparallel.microbatch import batch_leaves, move, padded, scatter
from devicekit.modelparallel.microbatch_threads import MicroBatchRunner, Stages, records_grad
from devicekit.modelparallel.output_join import join, warn_uneven
from devicekit.modelparallel.partition import Plan
from devicekit.modelparallel.per_sample import check_per_sample
from devicekit.modelparallel.recompute import checkpoint_stop, checkpointed, draws_random_numbers
from devicekit.modelparallel.state_guard import StateGuard, refuse_written_buffers

__all__ = ["ChainPipeline", "PipelineCallError"]


class PipelineCallError(InvalidValueError, TypeError):
    """A pipeline called with arguments its forward does not take (a TypeError, as Python's own)."""


class ChainPipeline:
    """The pipeline engine for a chain of parts (see the module doc)."""

    def __init__(self, model: nn.Module, chain: Chain | None, devices: Sequence[Any] | Plan, *, chunks: int,
                 balance: Balance, sample: Any, optimizer: str | float | None) -> None:
        self.name = type(model).__name__
        found = check_per_sample(chain, sample, chunks) if chain is not None and chunks > 1 and sample is not None \
            else None
        with StateGuard(model) as guard:  # building leaves every buffer as it was
            self.layers, self.plan = resolve(model if chain is None else chain, devices, balance, sample, optimizer)
        refuse_written_buffers(self.name, chunks, [*(found.written if found else ()), *guard.written])
        self.parts = make_parts(self.layers, self.plan)
        self._model = model
        # the traced chain, whose per-sample check runs on the first batch when no sample was given
        self._chain = chain
        self._unchecked = chunks > 1 and sample is None
        # per output tensor, the dimension that holds the batch (an LSTM's h_n: 1); None: all 0
        self._output_dims = found.output_dims if found is not None else None
        warn_uneven(self.name, chunks, found.uneven if found is not None else ())
        self._random = [m for part in self.parts for m in part.modules() if draws_random_numbers(m)]
        self._copies = [CopyStreams() for _ in self.plan.devices]  # one micro-batch per stage at a time
        self._runner = MicroBatchRunner(self.plan.devices)

    def _check(self, x: Any, chunks: int) -> None:
        """Once, on the first batch: a chain that mixes samples or writes buffers is refused."""
        if self._chain is not None:
            found = check_per_sample(self._chain, x, chunks)
            written = list(found.written)
            self._output_dims = found.output_dims
            warn_uneven(self.name, chunks, found.uneven)
        else:
            written = self._written_by_forward(x, chunks)
        refuse_written_buffers(self.name, chunks, written)
        self._unchecked = False

    def _written_by_forward(self, x: Any, chunks: int) -> list[str]:
        """Buffers (BatchNorm's aside) one micro-batch writes, run without grad; put back after."""
        if not any(b is not None for m in self._model.modules() if not isinstance(m, _BatchNorm)
                   for b in m._buffers.values()):
            return []  # no buffer to write: nothing to run
        first = scatter(x, chunks)[0]
        with StateGuard(self._model) as guard, torch.no_grad():
            for part, device in zip(self.parts, self.plan.devices, strict=True):
                first = part(move(first, device))
        return guard.written

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, chunks: int, checkpoint: str,
                 training: bool, discard: Callable[[], None]) -> tuple[Any, int, list[float]]:
        """The joined output, the number of micro-batches and per-stage busy seconds."""
        if kwargs or len(args) != 1:
            raise PipelineCallError(
                f"this pipeline runs {self.name}'s traced forward, which takes one batch; call "
                "pipe(batch) (a tuple or dict of tensors is one batch)")
        if self._unchecked:
            try:
                self._check(args[0], chunks)
            finally:
                discard()
        batches = scatter(args[0], chunks)
        marks = [mark(b) for b in batches]  # on the caller's stream
        # checkpointing only pays when training: in eval() or no_grad nothing is recomputed
        stop = checkpoint_stop(checkpoint, len(batches)) if torch.is_grad_enabled() and training else 0
        devices = self.plan.devices

        def body(i: int, stages: Stages) -> Any:
            x, since = batches[i], marks[i]
            for j, device in enumerate(devices):
                stages.enter(i, j)  # (stage 0: already there)
                x = self._copies[j].receive(x, device, since)
                part = self.parts[j]
                x = checkpointed(part, x, name=f"part {j} (layers {self.plan.parts[j].layer_range})") \
                    if i < stop else part(x)
                since = mark(x) if device.type == "cuda" else ()
            return x, since

        done, busy = self._runner.run(len(batches), body, random_active=any(m.training for m in self._random),
                                      records_grad=records_grad(self._model, batches), discard=discard)
        outputs = [_to_caller(x, since) for x, since in done]
        sizes = [padded(leaves[0]).size(0) if (leaves := batch_leaves(b)) else 1 for b in batches]
        return join(outputs, sizes, self._output_dims), len(batches), busy

    def close(self) -> None:
        """Stop the micro-batch threads (a later call starts new ones)."""
        self._runner.close()


def _to_caller(value: Any, marks: Any) -> Any:
    """The caller's stream waits for the last stage, and may use the output on its own stream."""
    for device, event in marks:
        torch.cuda.current_stream(device).wait_event(event)
    if marks:
        for t in tensors_in(value):
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))
    return value
