"""The truth an estimate is checked against: live storage bytes after every op of a real step.

On CPU torch keeps no allocator statistics, so :func:`measured_peak` counts it the way the
allocator would: the weights and the batch, plus every storage an op returns during the two
steps, each until its last reference dies (a weak reference tells when), sampled after every
op. The peak over the second step (the steady state: gradients, optimizer state, the kept
output and whatever its graph still saves exist) is the truth. Shared by
tests/memory/test_estimate_zoo.py and benchmarks/bench_estimate.py. :func:`allocator_peak` is a
second, independent truth: the CPU allocator's own allocations and frees, as torch's profiler
records them (every byte, whatever the tensor's layout), for the models whose tensors are not
plain storages (sparse gradients).

Usage::

    from tests.memory.memory_truth import measured_peak

    truth = measured_peak(model, sample, loss_fn=cross_entropy_loss)
    truth = measured_peak(model, sample, step=my_step)        # the user's own loop
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from devicekit.memory.draws import layer_kept_draw
from devicekit.memory.layouts import pieces
from devicekit.memory.step import (
    LoopOutput,
    make_optimizer,
    parse_precision,
    tensors,
    training_step,
)

__all__ = ["LiveStorages", "allocator_peak", "measured_peak"]


class LiveStorages(TorchDispatchMode):
    """Sums the bytes of live storages after every op; ``peak`` is the largest sum seen."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, Any] = {}

    def add(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
            return
        if tensor.layout != torch.strided:   # a sparse gradient: its indices and values
            for piece in pieces(tensor):
                self.add(piece)
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr() or id(storage)
        if key in self._seen and self._seen[key][0]() is not None:
            return
        size = storage.nbytes()
        self.live += size

        def gone(_ref: Any, key: int = key, size: int = size) -> None:
            self.live -= size
            self._seen.pop(key, None)

        self._seen[key] = (weakref.ref(storage, gone), size)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # LayerDrop (``if torch.rand([]) < p: skip``): a loop's peak is the step where every layer
        # runs, so that is the truth, not one random draw of it (a single step read up to 40 %
        # below it on Wav2Vec2 / HuBERT / SeamlessM4T in the transformers sweep)
        out = layer_kept_draw(func, args, kwargs or {})
        if out is None:
            out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self.add, out)
        self.peak = max(self.peak, self.live)
        return out


def _one_step(model: nn.Module, sample: Any, opt: torch.optim.Optimizer | None, *,
              precision: str | None, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
              step: Callable[[nn.Module, Any], Any] | None, keep_output: bool,
              training: bool) -> Callable[[], Any]:
    """One step of the loop, as a function of nothing: what it returns the loop keeps."""

    def one_step() -> Any:
        if not training:   # an eval loop: out = model(x) (or step(model, x)) under no_grad
            return training_step(model, sample, None, precision=precision, training=False,
                                 keep_output=keep_output, step=step)
        if step is None:
            return training_step(model, sample, opt, precision=precision, loss_fn=loss_fn,
                                 keep_output=keep_output)
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        dtype = parse_precision(precision)  # the estimate runs a step= under autocast: so does the truth
        with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
            out = step(model, sample)
        if opt is not None:
            opt.step()
        return out

    return one_step


def measured_peak(model: nn.Module, sample: Any, *, optimizer: Any = "adam",
                  precision: str | None = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                  step: Callable[[nn.Module, Any], Any] | None = None, keep_output: bool = True,
                  training: bool = True) -> int:
    """The peak live bytes of the second of two real training steps on CPU (see the module doc).

    As in a Python loop, what a step keeps stays alive until the next step's forward returns
    (``out = model(x)`` rebinds ``out`` then, before the backward): the model's output with
    ``keep_output`` (``out = model(x); loss = crit(out, y); loss.backward()``), or what
    ``step(model, sample)`` returns (it replaces forward, loss and backward; the optimizer step
    follows it). ``training=False``: an eval loop, two forwards (or steps) under no_grad.
    """
    opt = make_optimizer(optimizer, model.parameters()) if training else None
    one_step = _one_step(model, sample, opt, precision=precision, loss_fn=loss_fn, step=step,
                         keep_output=keep_output, training=training)
    # as a loop: the previous output dies when the next forward returns; what a step= returns
    # when the next step returns (``out = step(model, x)``)
    last = LoopOutput(model, until_forward=step is None)
    tracker = LiveStorages()
    for t in [*model.parameters(), *model.buffers(), *tensors(sample)]:
        tracker.add(t)
    t = None  # the loop variable must not keep a tensor alive
    # the first step is tracked too (every layer kept: each has its grads and state), so that
    # all it leaves alive counts: grads, optimizer state, the kept output and what that output's
    # graph still saves (an encoder whose output the loss never reached keeps its activations)
    with tracker:
        last.keep(one_step())
    tracker.peak = tracker.live   # the truth is the second step's peak
    with tracker:
        last.keep(one_step())
    last.close()
    return tracker.peak


_SECOND = "devicekit.truth.second_step"


def allocator_peak(model: nn.Module, sample: Any, *, optimizer: Any = "adam",
                   precision: str | None = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                   step: Callable[[nn.Module, Any], Any] | None = None, keep_output: bool = True,
                   training: bool = True) -> int:
    """The peak bytes the CPU allocator holds in the second of two real steps of the loop
    :func:`measured_peak` runs, from torch's profiler: the weights, buffers, batch and the state
    an optimizer makes when built, plus the running sum of every allocation and free."""
    from torch.profiler import ProfilerActivity, profile, record_function

    opt = make_optimizer(optimizer, model.parameters()) if training else None
    one_step = _one_step(model, sample, opt, precision=precision, loss_fn=loss_fn, step=step,
                         keep_output=keep_output, training=training)
    held = LiveStorages()
    made = [v for state in (opt.state.values() if opt is not None else ()) for v in state.values()
            if isinstance(v, torch.Tensor)]       # what an optimizer makes when built (Adagrad's sums)
    for t in [*model.parameters(), *model.buffers(), *tensors(sample), *made]:
        held.add(t)
    t = None
    del made
    last = LoopOutput(model, until_forward=step is None)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        last.keep(one_step())
        with record_function(_SECOND):
            last.keep(one_step())
    last.close()
    found = list(prof.profiler.kineto_results.events())
    second = min(e.start_ns() for e in found if e.name() == _SECOND)
    events = sorted((e.start_ns(), e.nbytes()) for e in found
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live, peak = held.live, 0
    for start, size in events:
        live += size
        if start >= second:
            peak = max(peak, live)
    return peak
