"""How one step is sized: on fake tensors, or by real CPU steps where fake tensors cannot run it.

:func:`size_step` runs the step on fake tensors (:mod:`.fake_step`). Two things can make that
the wrong step to size, and each is handled here:

* **One random number decides whether a layer runs** (LayerDrop, stochastic depth): such draws
  take one constant (:mod:`.draws`), and which constant runs every layer depends on how the
  model reads it (skip below a rate, or run below it); a step that drew any is sized both ways
  and the larger peak is kept, and the answer says so.
* **Fake tensors cannot run the model** (shapes that depend on values: ``nonzero``, routing,
  padding lengths; a fake kernel stricter than the real one): real CPU steps at small batches
  stand in: the whole batch where it is at most 128, else two smaller ones, extrapolated in the
  batch. They run on the rows of the caller's own sample where it has values (a real batch,
  tiled, or cut to its heaviest rows, so that the line drawn through them is never below the
  batch's: :func:`~devicekit.memory.real_step.real_peaks`), since the shapes follow the values; a sample of shapes only (meta tensors, the CLI's ``--input``) gets zeros, random
  normals and True, and the answer says those are not the caller's data. Before the batches
  that stand in, one real step at batch 2 tells a model that fails for real (a shape error)
  at the cost of two samples (not one: batch norm refuses a batch of 1 in training), and real
  steps that would not fit in this machine's free memory are refused rather than tried.

Usage (what :func:`~devicekit.memory.estimate.estimate_memory` does)::

    sized = size_step(model, sample, shapes, batch, training=True, target=torch.device("cpu"),
                      kwargs={"optimizer": "adam", "precision": None, "loss_fn": loss,
                              "keep_output": True, "step": None})
    sized.peak, sized.parts, sized.phase, sized.method, sized.timings
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from devicekit.errors import InvalidValueError
from devicekit.memory.cuda_terms import blas_workspaces_here
from devicekit.memory.draws import HIGH, LOW, drawing
from devicekit.memory.fake_step import CUDA_WORKSPACES, PARTS, fake_step
from devicekit.memory.real_step import fake_tensors_cannot_run, has_values, real_peaks
from devicekit.memory.step import tensors
from devicekit.units import format_size

__all__ = ["Sized", "refusal", "size_step"]

#: a batch up to this is measured whole by real CPU steps (the larger of the two batches an
#: extrapolation measures: no more memory than extrapolating needs); larger ones are
#: extrapolated from two smaller ones (routing, bucketing and caches make a batch of 1 or 2 a
#: poor guide: MoE models read 5-16 % low extrapolated from batches 1 and 2 to 4 in the
#: transformers sweep; unpadding read 9 % low from rows 8 and 16 of 32)
_MEASURE_AT_BATCH = 128
#: a failure that may be the model's own is first tried at this batch (batch norm in training
#: refuses a batch of 1)
_PROBE_BATCH = 2
#: real steps may use at most this share of the memory this machine has free
_REAL_STEP_SHARE = 0.5


@dataclass
class Sized:
    """The peak of one step, its parts then, its phase, how it was sized and where time went."""

    peak: int
    parts: dict[str, int]
    phase: str
    method: str = "fake tensors (nothing allocated)"
    timings: dict[str, float] = field(default_factory=dict)


def size_step(model: nn.Module, sample: Any, shapes: Any, batch: int | None, *, training: bool,
              target: torch.device, kwargs: dict[str, Any]) -> Sized:
    """The step's peak: ``shapes`` is ``sample`` resized to ``batch`` on the meta device."""
    runs: list[Sized] = []
    errors: list[Exception] = []
    draws = 0
    for value in (HIGH, LOW):
        with drawing(value) as drawn:
            try:
                runs.append(_size_once(model, sample, shapes, batch, training=training, target=target,
                                       kwargs=kwargs))
            except Exception as exc:   # drawn one way, every layer may skip: nothing left to train
                errors.append(exc)
        draws = draws or drawn.count
        if not draws:
            break                      # nothing drawn: there is only one way
    if not runs:
        raise errors[0]
    if not draws:
        return runs[0]
    larger = max(runs, key=lambda run: run.peak)
    timings: dict[str, float] = {}
    for run in runs:
        for name, seconds in run.timings.items():
            timings[name] = timings.get(name, 0.0) + seconds
    larger.timings = timings
    larger.method += (f"; {draws} one-number random draw(s) decide whether layers run"
                      " (LayerDrop, stochastic depth): sized with each drawn just below 1 and"
                      " at 0, the larger kept")
    return larger


def _size_once(model: nn.Module, sample: Any, shapes: Any, batch: int | None, *, training: bool,
               target: torch.device, kwargs: dict[str, Any]) -> Sized:
    start = time.perf_counter()
    try:
        peak, parts, phase = fake_step(model, shapes, training=training, device=target, **kwargs)
        return Sized(peak, parts, phase, timings={"fake-tensor step": time.perf_counter() - start})
    except InvalidValueError:
        raise
    except Exception as exc:
        # any fake-kernel failure (data-dependent shapes, a fake kernel stricter than the real
        # one: _grouped_mm's accepts only bf16) is tried for real on the CPU; only a model that
        # fails there too is refused, with the real error, so a sample that is fine is not blamed
        if not (training and batch is not None):
            raise refusal(model, shapes, exc, fake=fake_tensors_cannot_run(exc), step=kwargs.get("step")) from exc
        failed = time.perf_counter() - start
        peak, parts, phase, method = _extrapolated(model, sample, shapes, batch, exc, kwargs)
        timings = {"fake-tensor step (failed)": failed, "real CPU steps": time.perf_counter() - start - failed}
    if target.type == "cuda":  # CPU steps hold no cuBLAS workspace: assume forward and backward multiply
        parts[CUDA_WORKSPACES] = 2 * blas_workspaces_here().cublas
        peak += parts[CUDA_WORKSPACES]
    return Sized(peak, parts, phase, method, timings)


def refusal(model: nn.Module, shapes: Any, exc: BaseException, *, fake: bool = False,
            own_loop: bool = False, step: Any = None) -> InvalidValueError:
    """The refusal: the model (with the caller's ``step``, if any) failed on the sample for real,
    or, ``fake``, its shapes depend on values and a forward-only or batch-less estimate has no
    real steps to stand in. ``own_loop``: the assumed loop called the model (not the caller's
    step), so a model that wants other arguments is pointed to ``step=``."""
    first = _first_line(exc)
    shown = [tuple(t.shape) for t in tensors(shapes)]
    if fake:
        return InvalidValueError(
            f"model {type(model).__name__} cannot run on fake tensors for the sample {shown}"
            f" ({type(exc).__name__}: {first}): its shapes depend on values, and a forward-only"
            " (training=False, --inference) or batch-less estimate has no real steps to stand in;"
            " estimate the training step with a batched sample, or measure it")
    hint = ("; the default loop calls model(sample) (a dict: model(**sample)): a model that needs"
            " more (an encoder-decoder's decoder inputs or labels) takes your step: step= / --step"
            if own_loop and isinstance(exc, (TypeError, ValueError)) else "")
    who = (f"model {type(model).__name__}" if step is None else
           f"your step {getattr(step, '__name__', 'fn')} (model {type(model).__name__})")
    return InvalidValueError(f"{who} failed on the sample {shown}: {type(exc).__name__}: {first}{hint}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else ""


def _ran_at(exc: BaseException, batch: int) -> bool:
    """Whether ``exc`` came from the real step at ``batch`` (set by :func:`real_peaks`)."""
    return getattr(exc, "devicekit_batch", None) == batch


def _real_bytes(model: nn.Module, shapes: Any, batch: int) -> int:
    """The least a real step at ``batch`` holds: the inputs, and weights, gradients and two
    optimizer states of the model's size."""
    rows = sum(math.prod(t.shape[1:]) * t.element_size() for t in tensors(shapes) if t.dim())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return rows * batch + 4 * weights


def _free_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def _extrapolated(model: nn.Module, sample: Any, shapes: Any, batch: int, cause: BaseException,
                  kwargs: dict[str, Any]) -> tuple[int, dict[str, int], str, str]:
    """Peak and parts at ``batch`` from two real CPU steps at small batches.

    Each phase's peak (forward, backward, optimizer step) is a straight line in the batch: the
    optimizer step's hardly grows, the forward's and backward's grow with the activations, so
    the phase that peaks at a small batch need not be the one that peaks at ``batch``.
    """
    if batch <= _MEASURE_AT_BATCH:  # small enough to run as asked: one batch, no extrapolation
        b1 = b2 = batch
    else:
        b1 = min(batch // 4, _MEASURE_AT_BATCH // 2)
        b2 = 2 * b1
    own_loop = kwargs.get("step") is None
    needed, free = _real_bytes(model, shapes, b2), _free_bytes()
    if needed > _REAL_STEP_SHARE * free:
        raise InvalidValueError(
            f"model {type(model).__name__}: "
            f"{'fake tensors cannot run it' if fake_tensors_cannot_run(cause) else 'the step failed on fake tensors'}"
            f" ({type(cause).__name__}: {_first_line(cause)}), and the real CPU steps that would"
            f" stand in at batch {b2} need"
            f" at least {format_size(needed)}, more than half of this machine's free memory"
            f" ({format_size(free)}); check the sample's shapes, or estimate a smaller model") from cause
    values = sample if has_values(sample) else None
    # maybe a real failure (a shape error): two samples tell, before the batches that stand in
    # (not with a step=, which may hold tensors of the full batch that a small batch breaks)
    if own_loop and not fake_tensors_cannot_run(cause) and b2 > _PROBE_BATCH:
        try:
            real_peaks(model, shapes, values=values, batches=(_PROBE_BATCH,), **kwargs)
        except InvalidValueError:
            raise
        except Exception as exc:
            raise refusal(model, shapes, exc, own_loop=own_loop) from cause
    try:  # the batch asked for first (when it is one of the two): its failure is the model's
        second, first = (real_peaks(model, shapes, values=values, batches=(b2, b1), **kwargs) if b1 != b2
                         else 2 * real_peaks(model, shapes, values=values, batches=(b2,), **kwargs))
    except InvalidValueError:
        raise
    except Exception as exc:  # it fails for real too: the real error is the one to show
        # the default loop takes everything from the (resized) sample: its failure is the
        # model's; a step= may hold tensors of the full batch that a resize breaks
        if own_loop or (b2 == batch and (b1 == b2 or not _ran_at(exc, b1))):
            raise refusal(model, shapes, exc, own_loop=own_loop, step=kwargs.get("step")) from cause
        at = f"steps that stand in at batch {b1} and {b2}" if b1 != b2 else f"step at batch {b2}"
        raise InvalidValueError(
            f"model {type(model).__name__}: fake tensors cannot run it"
            f" ({type(cause).__name__}: {_first_line(cause)}), and the real CPU {at}"
            f" failed: {type(exc).__name__}: {_first_line(exc)}"
            " (a step= that holds tensors of the full batch, e.g. labels, cannot be resized: take"
            " them from its sample)") from cause

    def line(y1: float, y2: float) -> int:
        if b2 == b1:  # the batch asked for: measured as it is
            return max(round(y2), 0)
        # never below what the larger batch measured: memory does not shrink as the batch grows
        # (two steps that differ by more than the batch, e.g. random layer skips, can slope down)
        return max(round(y1 + (batch - b1) * (y2 - y1) / (b2 - b1)), round(y2), 0)

    best: tuple[int, dict[str, int], str] = (-1, {}, "")
    for phase, (p2, parts2) in second.items():
        p1, parts1 = first.get(phase, (p2, parts2))
        peak = line(p1, p2)
        if peak > best[0]:
            parts = {k: line(parts1.get(k, 0), parts2.get(k, 0)) for k in PARTS}
            best = (peak, parts, phase)
    peak, parts, phase = best
    parts["activations"] += peak - sum(parts.values())   # the line of the sum, not of the parts
    if parts["activations"] < 0:
        parts["temporaries"] += parts["activations"]
        parts["activations"] = 0
    why = (f"its shapes depend on values, {type(cause).__name__}" if fake_tensors_cannot_run(cause)
           else f"{type(cause).__name__}: {_first_line(cause)}")
    at = (f"real CPU steps at batch {b1} and {b2}, extrapolated to batch {batch}" if b2 != batch
          else f"real CPU steps at batch {batch}")
    data = ("on rows of the batch you gave" if values is not None else
            "on stand-in values (shapes only were given: zeros for integers, random normals,"
            " True; a model whose shapes follow the values, e.g. padding lengths or masks, may"
            " need more for real data: pass a real batch to estimate_memory in Python)")
    return peak, parts, phase, f"{at}, {data} (fake tensors cannot run it: {why})"
