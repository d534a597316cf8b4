"""One training step, written once: what ``estimate_memory`` sizes and what a test measures.

``training_step(model, sample, optimizer)`` runs ``optimizer.zero_grad(set_to_none=True)``,
the forward (under autocast when ``precision`` says so), the loss, the backward and the
optimizer step. The estimator runs exactly this function on fake tensors; the accuracy tests
run it on real ones under torch's own ``MemTracker`` or ``torch.cuda.max_memory_allocated``,
so both sides measure the same step.

Usage::

    from devicekit.memory.step import make_optimizer, training_step

    opt = make_optimizer("adam", model.parameters())
    training_step(model, batch, opt, precision="bf16")
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from devicekit.errors import InvalidValueError

__all__ = ["LoopOutput", "OPTIMIZERS", "PRECISIONS", "default_loss", "make_optimizer", "parse_precision",
           "StepFn", "tensors", "training_step"]

#: optimizer name -> (class, keyword arguments)
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "adam": ("Adam", {}),
    "adamw": ("AdamW", {}),
    "sgd": ("SGD", {"lr": 0.01}),
    "sgd-momentum": ("SGD", {"lr": 0.01, "momentum": 0.9}),
    "momentum": ("SGD", {"lr": 0.01, "momentum": 0.9}),
    "rmsprop": ("RMSprop", {}),
    "adagrad": ("Adagrad", {}),
    "adafactor": ("Adafactor", {}),
    "adadelta": ("Adadelta", {}),
    "adamax": ("Adamax", {}),
    "nadam": ("NAdam", {}),
    "radam": ("RAdam", {}),
    "sparse-adam": ("SparseAdam", {}),   # sparse gradients only (nn.Embedding(sparse=True))
}

#: precision name -> autocast dtype (None: no autocast)
PRECISIONS: dict[str, torch.dtype | None] = {
    "fp32": None, "float32": None, "none": None,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}

OptimizerSpec = str | Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None


def parse_precision(precision: str | torch.dtype | None) -> torch.dtype | None:
    """The autocast dtype for ``precision`` (None, "bf16", "fp16", "fp32" or a dtype)."""
    if precision is None:
        return None
    if isinstance(precision, torch.dtype):
        if precision in (torch.bfloat16, torch.float16):
            return precision
        if precision == torch.float32:
            return None
    elif isinstance(precision, str) and precision.lower() in PRECISIONS:
        return PRECISIONS[precision.lower()]
    raise InvalidValueError(f"precision {precision!r} is unknown; use 'bf16', 'fp16', 'fp32' or None")


def make_optimizer(spec: OptimizerSpec, params: Iterable[nn.Parameter],
                   *, foreach: bool | None = None) -> torch.optim.Optimizer | None:
    """An optimizer over ``params`` from a name (see :data:`OPTIMIZERS`), a factory or None."""
    params = [p for p in params if p.requires_grad]
    if spec is None or (isinstance(spec, str) and spec.lower() == "none"):
        return None
    if callable(spec) and not isinstance(spec, str):
        return spec(params)
    if not isinstance(spec, str) or spec.lower() not in OPTIMIZERS:
        names = ", ".join(repr(k) for k in OPTIMIZERS)
        raise InvalidValueError(f"optimizer {spec!r} is unknown; use one of {names}, None, "
                                "or a function params -> torch.optim.Optimizer")
    cls_name, kwargs = OPTIMIZERS[spec.lower()]
    cls = getattr(torch.optim, cls_name)
    if foreach is not None and "foreach" in inspect.signature(cls).parameters:   # not SparseAdam's
        kwargs = {**kwargs, "foreach": foreach}
    return cls(params, **kwargs)


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj`` (tensors, tuples, lists, dicts, dataclass-like objects)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors(item)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
        for item in vars(obj).values():
            yield from tensors(item)


def default_loss(output: Any, sample: Any) -> torch.Tensor:
    """The sum of every floating tensor in the output that needs a gradient."""
    parts = [t.sum() for t in tensors(output) if t.is_floating_point() and t.requires_grad]
    if not parts:
        raise InvalidValueError(
            "the model's output holds no floating tensor that needs a gradient, so there is no "
            "backward to size; pass training=False, or a loss_fn(output, sample)"
        )
    loss = parts[0]
    for part in parts[1:]:
        loss = loss + part
    return loss


def call_model(model: nn.Module, sample: Any) -> Any:
    """``model(*sample)`` for a tuple/list, ``model(**sample)`` for a dict, else ``model(sample)``."""
    if isinstance(sample, tuple):
        return model(*sample)
    if isinstance(sample, dict):
        return model(**sample)
    return model(sample)


StepFn = Callable[[nn.Module, Any], Any]


def training_step(
    model: nn.Module,
    sample: Any,
    optimizer: torch.optim.Optimizer | None,
    *,
    precision: str | torch.dtype | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    training: bool = True,
    device_type: str | None = None,
    keep_output: bool = False,
    step: StepFn | None = None,
) -> Any:
    """Run one step: zero grads, forward (+ autocast), loss, backward, optimizer step.

    ``training=False`` runs the forward only (or ``step``), under ``torch.no_grad()``, and returns
    the output with ``keep_output`` (what ``step`` returns), as an eval loop keeps it. ``keep_output``: the
    output stays alive through the backward and is returned, as ``out = model(x); loss =
    crit(out, y); loss.backward()`` keeps it (the caller drops it when the next forward returns:
    :class:`LoopOutput`). ``step(model, sample)`` replaces forward, loss and backward with the
    user's own; what it returns is returned (the caller keeps it as ``out = step(model, x)``
    does: until the next step returns).
    """
    dtype = parse_precision(precision)
    if device_type is None:
        first = next(tensors(sample), None)
        device_type = first.device.type if first is not None else "cpu"
    autocast = torch.autocast(device_type=device_type, dtype=dtype) if dtype is not None else nullcontext()
    if not training:   # an eval loop: ``out = model(x)`` (or ``out = step(model, x)``) under no_grad
        with torch.no_grad(), autocast:
            if step is not None:
                return step(model, sample)
            output = call_model(model, sample)
        return output if keep_output else None
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        for p in model.parameters():
            p.grad = None
    if step is not None:
        with autocast:
            kept = step(model, sample)
    else:
        with autocast:
            output = call_model(model, sample)
            loss = (loss_fn or default_loss)(output, sample)
        kept = output if keep_output else None
        del output
        loss.backward()
        del loss
    if optimizer is not None:
        optimizer.step()
    return kept


class LoopOutput:
    """What a training loop keeps of its last step, for as long as a real loop keeps it.

    ``out = model(x); loss = crit(out, y); loss.backward()`` rebinds ``out`` as soon as the next
    forward returns, so the previous step's output is gone before the next backward: a forward
    hook on the model drops the previous value when the model's next forward returns (its first
    call in a step); :meth:`keep` holds the new one. A ``step=`` is called as ``out =
    step(model, x)``: what it returns is rebound only when the next call returns, so with
    ``until_forward=False`` the previous value lives through the whole next step (a step that
    returns nothing keeps nothing). Usage::

        with LoopOutput(model) as last:
            for _ in range(2):
                last.keep(training_step(model, sample, opt, keep_output=True))
    """

    def __init__(self, model: nn.Module, *, until_forward: bool = True) -> None:
        self._value: list[Any] = []
        self._handle = model.register_forward_hook(self._drop) if until_forward else None

    def _drop(self, *_: Any) -> None:
        self._value.clear()

    def keep(self, value: Any) -> None:
        self._value[:] = [value]

    @property
    def value(self) -> Any:
        """What the loop holds now (None once the next forward has returned)."""
        return self._value[0] if self._value else None

    def close(self) -> None:
        self._value.clear()
        if self._handle is not None:
            self._handle.remove()

    def __enter__(self) -> LoopOutput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
