"""When fake tensors cannot run a model: real steps at small batches, extrapolated in the batch.

A model whose shapes depend on values (``nonzero``, top-k routing in a mixture of experts,
``if x.sum() > 0``) cannot run on fake tensors: there are no values. Running beats faking
then: :func:`real_peaks` runs two real training steps on the CPU at a smaller batch and at twice
that, counting live storage bytes with the same tracker the fake step uses, and the estimate
extrapolates the peak linearly in the batch size (and says that it did). A model on the meta
device has no values either: that stays a one-line refusal.

Usage::

    from devicekit.memory.real_step import fake_tensors_cannot_run, real_peaks

    try:
        ...                                    # the fake step
    except Exception as exc:
        if fake_tensors_cannot_run(exc):
            low, high = real_peaks(model, sample, batches=(4, 8), ...)   # phase -> (peak, parts)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from devicekit.errors import InvalidValueError
from devicekit.memory.fake_step import LiveBytes, phase_hooks, plain_tensor_copies, sample_batch
from devicekit.memory.step import (
    LoopOutput,
    OptimizerSpec,
    StepFn,
    make_optimizer,
    tensors,
    training_step,
)
from devicekit.placement.walk import map_tensors

__all__ = ["fake_tensors_cannot_run", "has_values", "real_peaks"]

_DATA_DEPENDENT = ("DynamicOutputShapeException", "DataDependentOutputException",
                   "GuardOnDataDependentSymNode", "UnsupportedOperatorException",
                   "UnsupportedFakeTensorException")


def fake_tensors_cannot_run(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) says the model needs values that fake tensors lack."""
    seen: BaseException | None = exc
    while seen is not None:
        if type(seen).__name__ in _DATA_DEPENDENT:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def has_values(sample: Any) -> bool:
    """Whether every tensor of ``sample`` holds values (none is on the meta device or fake)."""
    found = list(tensors(sample))
    return bool(found) and not any(t.is_meta or isinstance(t, FakeTensor) for t in found)


def _by_weight(values: Any, full: int) -> torch.Tensor:
    """The rows of ``values`` heaviest first (most nonzero elements: tokens a mask keeps, ids
    that are not padding), rows that hold as much in their order (all alike: ``arange``)."""
    weight = torch.zeros(full, dtype=torch.long)
    for t in tensors(values):
        if t.dim() and t.shape[0] == full and t.numel():
            weight -= (t.detach().cpu().reshape(full, -1) != 0).sum(1)
    return torch.sort(weight, stable=True).indices


def _real_sample(sample: Any, batch: int, values: Any = None) -> Any:
    """``sample`` at ``batch`` on the CPU: rows of ``values`` where given, spread evenly over the
    whole batch ranked by weight (:func:`_by_weight`), from the heaviest: every other row of the
    ranking for half the batch, every fourth for a quarter (a batch sorted by length has its
    short rows first: the first rows alone sized a packed LSTM 35 % low; rows 8 and 16 of 32,
    spread in batch order, held 1210 tokens where the batch held 1376 and read 9 % low), so each
    row stands for the lighter ones after it, the quarter's rows are the half's, and the line
    through the two is not below the batch; repeated in turn past its end; else stand-ins
    (random normals, zeros, True). Only tensors whose first dimension is the sample's batch are
    resized."""
    if values is not None:
        full = sample_batch(values)
        ranked = _by_weight(values, full) if batch < full else None

        def rows(t: torch.Tensor) -> torch.Tensor:
            t = t.detach().cpu()
            if not t.dim() or t.shape[0] != full:
                return t.clone()
            if ranked is not None:
                return t[ranked[(torch.arange(batch) * full) // batch].sort().values]
            index = torch.arange(batch) % full
            return t[index]

        return map_tensors(values, rows)
    full = sample_batch(sample)

    def make(t: torch.Tensor) -> torch.Tensor:
        shape = [batch, *t.shape[1:]] if t.dim() and t.shape[0] == full else list(t.shape)
        if t.is_floating_point():
            return torch.randn(shape, dtype=t.dtype)
        if t.dtype == torch.bool:
            return torch.ones(shape, dtype=torch.bool)
        return torch.zeros(shape, dtype=t.dtype)

    return map_tensors(sample, make)


def real_peaks(model: nn.Module, sample: Any, *, batches: tuple[int, ...], optimizer: OptimizerSpec,
               precision: torch.dtype | None, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
               keep_output: bool, step: StepFn | None, values: Any = None,
               ) -> list[dict[str, tuple[int, dict[str, int]]]]:
    """Per batch: phase -> (peak, parts at it) of the second of two real CPU steps, on rows of
    ``values`` (the caller's sample, with values) or on stand-ins shaped as ``sample``."""
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        raise InvalidValueError(f"model {type(model).__name__} is on the meta device and its shapes "
                                "depend on values, so neither fake nor real steps can size it; "
                                "build it on the CPU at a small size, or pass step=")
    results = []
    for batch in batches:
        try:
            results.append(_peaks_at(model, sample, batch, optimizer=optimizer,
                                     precision=precision, loss_fn=loss_fn,
                                     keep_output=keep_output, step=step, values=values))
        except InvalidValueError:
            raise
        except Exception as exc:
            exc.devicekit_batch = batch  # type: ignore[attr-defined]  (which step failed)
            raise
    return results


def _peaks_at(model: nn.Module, sample: Any, batch: int, *, optimizer: OptimizerSpec,
              precision: torch.dtype | None, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
              keep_output: bool, step: StepFn | None, values: Any = None,
              ) -> dict[str, tuple[int, dict[str, int]]]:
    """Phase -> (peak, parts at it) of the second of two real CPU steps at ``batch``."""
    real = copy.deepcopy(model, plain_tensor_copies(model, torch.Tensor.clone, graph_only=True)).cpu()
    tracker = LiveBytes("cpu")
    for t in [*real.parameters(), *real.buffers()]:
        tracker.track(t, "weights")
    data = _real_sample(sample, batch, values)
    for t in tensors(data):
        tracker.track(t, "inputs")
    opt = make_optimizer(optimizer, real.parameters())
    hooks = phase_hooks(real, opt, tracker)
    last = LoopOutput(real, until_forward=step is None)  # as in fake_step
    try:
        with tracker:
            for index in range(2):
                if index == 1:
                    tracker.restart_peak()
                last.keep(training_step(real, data, opt, precision=precision, loss_fn=loss_fn,
                                        device_type="cpu", keep_output=keep_output, step=step))
                tracker.phase, tracker.part = "after step", "temporaries"
    finally:
        last.close()
        for handle in hooks:
            handle.remove()
    peaks = dict(tracker.phase_peaks)
    del real, opt, data
    return peaks
