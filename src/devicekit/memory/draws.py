"""Random draws that decide whether a layer runs, drawn so that every layer runs.

LayerDrop and stochastic depth decide with one random number whether a layer runs. Memory must
hold the step in which every layer runs, and a fake tensor has no value to compare, so a single
random number (``torch.rand([])``, ``torch.rand(1)``) is drawn as a constant that fake tensors
can compare, on fake tensors and in the real CPU steps that stand in for them alike. Which
constant runs every layer depends on how the model reads it:

* ``if torch.rand([]) < config.layerdrop: continue`` (Wav2Vec2, HuBERT and other transformers
  models): skip below a rate, so a draw just below 1 runs every layer (:data:`HIGH`, the
  default);
* ``if torch.rand(1) < survival: x = x + block(x)`` (stochastic depth written the other way
  round): run below a rate, so a draw of 0 does (:data:`LOW`);
* ``if torch.bernoulli(p): ...``: a one-number coin is 1 under :data:`HIGH`, 0 under :data:`LOW`.

Not seen, so not handled: Python's own ``random.random()``, an in-place ``uniform_()``, and a
model mixing both conventions in one step (neither constant runs every layer).

The estimate sizes a step that drew such numbers both ways and keeps the larger (``drawing``).
Larger draws (dropout masks) are untouched.

Usage::

    from devicekit.memory.draws import HIGH, LOW, drawing, layer_kept_draw

    out = layer_kept_draw(func, args, kwargs)        # inside a dispatch mode
    if out is None:
        out = func(*args, **kwargs)

    with drawing(LOW) as drawn:                      # around a step: draws are 0, and counted
        ...
    drawn.count
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HIGH", "LOW", "Drawn", "drawing", "layer_kept_draw"]

_DRAWS = {torch.ops.aten.rand.default, torch.ops.aten.rand.generator}
_COINS = {torch.ops.aten.bernoulli.default}
HIGH = 1.0 - 2.0 ** -24     # the largest float32 below 1: "skip below a rate" runs every layer
LOW = 0.0                   # "run below a rate" runs every layer


@dataclass
class Drawn:
    """The value one-number draws take, and how many were drawn."""

    value: float = HIGH
    count: int = 0


_CURRENT: contextvars.ContextVar[Drawn | None] = contextvars.ContextVar("devicekit_draw", default=None)


@contextlib.contextmanager
def drawing(value: float) -> Iterator[Drawn]:
    """One-number draws made inside take ``value``; the Drawn yielded counts them."""
    drawn = Drawn(value)
    token = _CURRENT.set(drawn)
    try:
        yield drawn
    finally:
        _CURRENT.reset(token)


def _next_value() -> float:
    """The value of the next one-number draw (:data:`HIGH` outside ``drawing``), counted."""
    drawn = _CURRENT.get()
    if drawn is None:
        return HIGH
    drawn.count += 1
    return drawn.value


def layer_kept_draw(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A constant (:data:`HIGH`, or what ``drawing`` set) for a one-number ``torch.rand``, and 1
    or 0 for a one-number ``torch.bernoulli`` (``if torch.bernoulli(p): x = x + block(x)``);
    None for any other op."""
    if func in _COINS:
        return _coin(args[0], kwargs)
    if func not in _DRAWS or math.prod(args[0]) != 1:
        return None
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    # made inside the caller's dispatch mode: under fake tensors this is a constant fake tensor,
    # which comparisons evaluate
    draw = torch.tensor(_next_value(), dtype=dtype, device=kwargs.get("device"))
    return draw.reshape(list(args[0]))


def _coin(p: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``torch.bernoulli(p)`` of one number: 1 under :data:`HIGH`, 0 under :data:`LOW`."""
    if not isinstance(p, torch.Tensor) or p.numel() != 1:
        return None
    value = 1.0 if _next_value() == HIGH else 0.0
    # torch.tensor: a constant under fake tensors, which `if coin:` can read (as a draw above)
    return torch.tensor(value, dtype=p.dtype, device=p.device).reshape(p.shape)
