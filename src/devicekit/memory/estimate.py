"""Will it fit? The peak memory of one training step, before running it.

``estimate_memory(model, sample)`` runs the model's real forward, backward and optimizer step
on fake tensors (see :mod:`devicekit.memory.fake_step`): nothing of the model's size is
allocated, so a model built on the meta device (``with torch.device("meta"):``) is sized on
a laptop. Everything the step does is counted, because it is what runs: saved activations,
temporaries of the backward, the optimizer's state and its temporaries, autocast copies
(``precision="bf16"``), a model made half by ``dk.half``, and activation checkpointing.
Unlike accelerate's ``estimate-memory`` (weights x 4 for Adam, no activations) the answer is
the peak of the step. Kernels whose fake version allocates less than the real one (an LSTM's
oneDNN workspace, cuDNN's reserve space) are sized as the real one (:mod:`.real_kernels`).

What runs is the user's loop: ``step=fn`` runs ``fn(model, sample)`` (forward, loss,
``backward()``, as the user's loop does; what it returns is kept as ``out = step(model, x)``
keeps it: through the whole next step), and
devicekit adds the optimizer step. Without it the common loop is assumed: ``out = model(x);
loss = crit(out, y); loss.backward()`` with ``out`` alive until the next forward returns (a
loop rebinds ``out`` then, before the backward: :class:`~devicekit.memory.step.LoopOutput`), and
``loss_fn`` (a function, or "cross-entropy", "mse", "sum"; default: cross-entropy over the last
dimension, never cheaper than a language model's loss). The table says what was assumed.
Inference (``training=False``) sizes an eval loop the same way: ``out = model(x)`` under
no_grad keeps the previous output through the next forward (or ``step=`` runs the user's).
On CUDA the answer is a range (``low``, ``peak``, ``high``) of what nvidia-smi will show; a
model whose shapes depend on values is sized by real CPU steps: the whole batch up to 128, or a
quarter and half of it (at most 64 and 128, the heaviest rows), extrapolated.

Usage::

    import torch
    import devicekit as dk

    est = dk.estimate_memory(model, torch.empty(32, 3, 224, 224, device="meta"))
    print(est)                          # table: parts, peak, when the peak happens
    est.peak, est.parts["activations"]
    est.max_batch_size("20GiB")         # largest batch within 20 GiB, from fake runs only
    dk.estimate_memory(model, sample, precision="bf16", batch_size=64, optimizer="sgd")
    dk.estimate_memory(model, sample, loss_fn="mse")
    dk.estimate_memory(model, sample, step=my_step)   # my_step(model, sample): forward, loss, backward
    est.fits("24GiB"), est.fits(dk.gpus()[0]).reason
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from devicekit.errors import InvalidValueError
from devicekit.memory.fake_step import CUDA_WORKSPACES, PARTS, resize_batch, sample_batch
from devicekit.memory.fit_check import Fit, check_fit
from devicekit.memory.gpu_overhead import gpu_range
from devicekit.memory.layouts import UnsizedLayoutError
from devicekit.memory.losses import LossFn, resolve_loss
from devicekit.memory.sizing import size_step
from devicekit.memory.step import OptimizerSpec, StepFn, parse_precision, tensors
from devicekit.units import format_size, parse_size

#: what a CUDA estimate of a model with convolutions leaves out (:mod:`.cuda_terms`: not sized)
_CONV_WORKSPACES = ("cuDNN's convolution workspaces: cuDNN picks them at run time, 0 to 130 MiB beyond "
                    "the tensors on an H200 for the zoo's small CNNs, more for larger convolutions; "
                    "leave that room, or size the batch on the GPU with dk.find_batch_size")

__all__ = ["MemoryEstimate", "estimate_memory", "default_estimate_device"]


def default_estimate_device() -> torch.device:
    """``cuda`` where this torch can use CUDA (the step then matches a GPU's), else ``cpu``."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class MemoryEstimate:
    """The peak bytes of one step and its parts at that moment (they add up to ``peak``)."""

    peak: int
    parts: dict[str, int]
    peak_phase: str
    batch_size: int | None
    device: torch.device
    training: bool
    optimizer: str
    precision: str
    parameters: int
    seconds: float
    loss: str = "sum"
    loop: str = ""
    method: str = "fake tensors"
    low: int = 0                       # on CUDA: what nvidia-smi shows, at least / about / at most
    expected: int = 0
    high: int = 0
    convolutions: bool = False
    timings: dict[str, float] = field(default_factory=dict)   # where ``seconds`` went
    _again: Callable[[int], MemoryEstimate] | None = field(default=None, repr=False, compare=False)

    @property
    def weights(self) -> int:
        """Bytes of parameters and buffers."""
        return self.parts["weights"]

    @property
    def model_state(self) -> int:
        """What does not depend on the batch: weights, gradients and optimizer state."""
        return self.parts["weights"] + self.parts["gradients"] + self.parts["optimizer state"]

    def at_batch_size(self, batch_size: int) -> MemoryEstimate:
        """The same estimate for another batch size (fake runs; real CPU steps for a model whose
        shapes depend on values, as the first estimate)."""
        if self._again is None or self.batch_size is None:
            raise InvalidValueError("this estimate has no batch dimension to change; pass batch_size=")
        return self._again(_positive(batch_size, "batch_size"))

    def max_batch_size(self, budget: int | str, *, limit: int = 1 << 20) -> int:
        """The largest batch whose step peaks within ``budget`` (bytes or "20GiB"); 0 if none.

        From how the peak grows with the batch (two fake runs give the slope), then checked
        with fake runs at the answer and one above it; no real memory is used, but for a model
        whose shapes depend on values, which each run sizes by real CPU steps (up to batch 128).
        The search stops at ``limit`` (2**20 rows by default): an answer equal to it says only
        that so many fit, with a warning; pass a larger ``limit`` for the true maximum.
        """
        room = parse_size(budget, name="budget")
        limit = _positive(limit, "limit")
        if self._again is None or self.batch_size is None:
            raise InvalidValueError("this estimate has no batch dimension; pass a sample with one")
        memo: dict[int, int] = {self.batch_size: self.peak}

        def peak(b: int) -> int:
            if b not in memo:
                memo[b] = self._again(b).peak  # type: ignore[misc]
            return memo[b]

        b0 = self.batch_size
        b1 = b0 * 2
        slope = max((peak(b1) - peak(b0)) / (b1 - b0), 1e-9)
        fixed = peak(b0) - slope * b0
        guess = int(max(min((room - fixed) / slope, limit), 0))
        lo, hi = 0, limit + 1  # peak(lo) fits (or lo == 0); peak(hi) does not
        for candidate in (guess, guess + 1):
            if candidate < 1:
                continue
            if peak(candidate) <= room:
                lo = max(lo, candidate)
            else:
                hi = min(hi, candidate)
        while hi - lo > 1 and len(memo) < 24:  # the line was off: bisect with fake runs
            mid = (lo + hi) // 2 if hi <= limit else min(lo * 2 or 1, limit)
            if peak(mid) <= room:
                lo = mid
            else:
                hi = mid
        if lo >= limit:
            import warnings

            warnings.warn(BatchLimitWarning(f"batch {limit:,} fits in {format_size(room)} and the search stops there"
                          f" (limit={limit}): the largest batch may be larger; pass a larger limit="),
                          stacklevel=2)
        return min(lo, limit)

    def fits(self, target: int | str | Any) -> Fit:
        """Whether the step fits ``target`` (a size such as "24GiB", or a ``dk.GPU``), and why."""
        return check_fit(self.peak, self.low or self.peak, self.high or self.peak, self.device.type,
                         target, convolutions=self.convolutions)

    def rows(self) -> list[tuple[str, int]]:
        """(part, bytes) for every part, then the peak."""
        extra = [name for name in self.parts if name not in PARTS]   # on CUDA: "cuda workspaces"
        return [(name, self.parts.get(name, 0)) for name in (*PARTS, *extra)] + [("peak", self.peak)]

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON."""
        return {"peak": self.peak, "parts": dict(self.parts), "peak_phase": self.peak_phase,
                "batch_size": self.batch_size, "device": str(self.device), "training": self.training,
                "optimizer": self.optimizer, "precision": self.precision,
                "parameters": self.parameters, "seconds": round(self.seconds, 4), "timings": dict(self.timings),
                "loss": self.loss, "loop": self.loop, "method": self.method,
                "low": self.low, "expected": self.expected, "high": self.high,
                "measures": "nvidia-smi" if self.device.type == "cuda" else "bytes allocated",
                "not in the peak": [_CONV_WORKSPACES] if self.device.type == "cuda" and self.convolutions else []}

    def __str__(self) -> str:
        mode = f"training, optimizer {self.optimizer}" if self.training else "inference"
        head = (f"memory of one step ({mode}, precision {self.precision}, batch "
                f"{self.batch_size if self.batch_size is not None else '?'}, {self.device.type}, "
                f"{self.parameters:,} parameters)")
        width = max(len(name) for name, _ in self.rows())
        lines = [head]
        for name, size in self.rows():
            share = f"{100 * size / self.peak:5.1f} %" if self.peak else ""
            lines.append(f"  {name:<{width}}  {format_size(size):>10}  {share}")
        lines.append(f"  peak during the {self.peak_phase or 'step'}")
        if self.device.type == "cuda":
            lines.append(f"  nvidia-smi will show about {format_size(self.expected)} ({format_size(self.low)} "
                         f"to {format_size(self.high)}: "
                         "the peak above, plus the caching allocator's reserve, the CUDA context and "
                         "cuBLAS/cuDNN workspaces)")
            if self.convolutions:
                lines.append(f"  not in the peak: {_CONV_WORKSPACES}")
        else:
            lines.append("  (bytes allocated at the peak; no caching allocator on the CPU)")
        lines.append(f"  sized by: {self.method}")
        if self.training:
            lines.append(f"  loop: {self.loop}; loss: {self.loss}")
            if "assumed" in self.loop or "assumed" in self.loss:
                lines.append("  give yours: step=fn / --step MODULE:FN (forward, loss, backward), "
                             "or loss_fn= / --loss cross-entropy|mse|sum")
        elif self.loop:
            lines.append(f"  loop: {self.loop}")
            if "assumed" in self.loop:
                lines.append("  give yours: step=fn / --step MODULE:FN (what your eval loop runs and keeps)")
        return "\n".join(lines)


class BatchLimitWarning(UserWarning):
    """``max_batch_size`` reached its ``limit``: the true largest batch may be larger."""


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidValueError(f"{name} {value!r} must be a positive integer")
    return value


def estimate_memory(
    model: nn.Module,
    sample: Any,
    *,
    optimizer: OptimizerSpec = "adam",
    precision: str | torch.dtype | None = None,
    training: bool = True,
    batch_size: int | None = None,
    loss_fn: str | LossFn | None = None,
    step: StepFn | None = None,
    device: str | torch.device | None = None,
) -> MemoryEstimate:
    """The peak memory of one step of ``model`` on ``sample``; see the module doc.

    ``sample``: what the model is called with (a tensor, a tuple of positional arguments, or a
    dict of keyword arguments); only shapes and dtypes matter, so meta tensors are fine.
    ``batch_size`` replaces the first dimension of every tensor in it. ``optimizer``: a name
    (adam, adamw, sgd, sgd-momentum, rmsprop, adagrad, adafactor, adadelta, adamax, nadam,
    radam, sparse-adam), None, or a function params ->
    optimizer. ``precision``: None, "bf16" or "fp16" (autocast). ``loss_fn(output, sample)``
    or "cross-entropy" / "mse" / "sum": the loss (default: cross-entropy, assumed).
    ``step(model, sample)``: the user's forward, loss and backward instead (with ``training=False``:
    what the user's eval loop runs, under no_grad). ``device``: what the
    step is sized for (default: cuda where torch has CUDA, else cpu).
    """
    if not isinstance(model, nn.Module):
        raise InvalidValueError(f"model {type(model).__name__} is not an nn.Module")
    if batch_size is not None:
        _positive(batch_size, "batch_size")
    if next(tensors(sample), None) is None:
        raise InvalidValueError(f"sample {type(sample).__name__} holds no tensor; pass one batch, "
                                "e.g. torch.empty(8, 3, 224, 224, device='meta')")
    odd = next((t for t in tensors(sample) if t.layout != torch.strided), None)
    if odd is not None:   # resized as shapes, it would be sized dense: as large as its dense shape
        raise UnsizedLayoutError(
            f"sample tensor of layout {odd.layout} (shape {tuple(odd.shape)}): the estimate sizes "
            "samples of dense (strided) tensors only, and would count this one as dense; make it "
            "inside the model (the step's own sparse tensors are counted), or measure the step")
    if step is not None and (not callable(step) or loss_fn is not None):
        raise InvalidValueError(f"step {step!r}: give a function step(model, sample) that runs the "
                                "forward, the loss and backward(), and no loss_fn beside it")
    dtype = parse_precision(precision)
    loss, loss_name = resolve_loss(loss_fn)
    if step is not None:
        loss_name = "computed by the step"
        loop = (f"step={getattr(step, '__name__', 'fn')} (yours), then the optimizer step; what it "
                "returns kept through the next step (out = step(model, x))")
        if not training:
            loop = (f"step={getattr(step, '__name__', 'fn')} (yours) under no_grad; what it returns "
                    "kept through the next step (out = step(model, x))")
    elif training:
        loop = "out = model(x); loss(out).backward(); out kept until the next forward returns (assumed)"
    else:
        loop = "out = model(x) under no_grad; out kept until the next forward returns (assumed)"
    target = _target(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise InvalidValueError(f"device {str(target)!r}: this torch has no CUDA, so a CUDA step "
                                "cannot be traced here; use device='cpu'")
    if training and optimizer is not None and not any(p.requires_grad for p in model.parameters()):
        raise InvalidValueError(f"model {type(model).__name__} has no trainable parameters, so the "
                                "optimizer has nothing to step: pass optimizer=None (--optimizer none) "
                                "to size the forward and backward, or training=False (--inference)")
    shapes = resize_batch(sample, batch_size)
    batch = sample_batch(shapes)
    kwargs: dict[str, Any] = {"optimizer": optimizer, "precision": dtype, "loss_fn": loss,
                              "keep_output": step is None, "step": step}
    start = time.perf_counter()
    sized = size_step(model, sample, shapes, batch, training=training, target=target, kwargs=kwargs)
    peak, parts, phase, method, timings = sized.peak, sized.parts, sized.phase, sized.method, sized.timings
    seconds = time.perf_counter() - start

    def again(b: int) -> MemoryEstimate:
        return estimate_memory(model, sample, optimizer=optimizer, precision=precision, training=training,
                               batch_size=b, loss_fn=loss_fn, step=step, device=target)

    convolutions = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    low, expected, high = gpu_range(peak, convolutions=convolutions, hopper=_hopper(),
                                    workspaces_counted=CUDA_WORKSPACES in parts) \
        if target.type == "cuda" else (peak, peak, peak)
    name = optimizer if isinstance(optimizer, str) else ("none" if optimizer is None else "custom")
    return MemoryEstimate(
        peak=peak, parts=parts, peak_phase=phase, batch_size=batch, device=target,
        training=training, optimizer=name if training else "none",
        precision={None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype],
        parameters=sum(p.numel() for p in model.parameters()), seconds=seconds,
        loss=loss_name if training else "none", loop=loop,
        method=method, low=low, expected=expected, high=high, convolutions=convolutions,
        timings={k: round(v, 3) for k, v in timings.items()},
        _again=again if batch is not None else None,
    )


def _target(device: str | torch.device | None) -> torch.device:
    """The device the step is sized for: cpu or cuda (another device type would abort the
    process inside torch's fake kernels, not raise)."""
    if device is None:
        return default_estimate_device()
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidValueError(f"device {device!r} is not a device; give 'cpu' or 'cuda'") from None
    if target.type not in ("cpu", "cuda"):
        raise InvalidValueError(f"device {str(target)!r}: steps are sized for 'cpu' or 'cuda' only")
    return target


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
