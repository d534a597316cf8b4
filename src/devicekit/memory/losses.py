"""The losses an estimate can assume: cross-entropy, mse, sum, or the user's own function.

A loss is part of what a step keeps alive: ``out.sum()`` saves nothing, cross-entropy saves
its softmax (as big as the logits), mse its difference. When the user gives none, the estimate
assumes cross-entropy on every floating output with a class dimension (the last one), against
integer targets made from the output's shape, so it is never cheaper than a language model's
loss; a 1-d output is summed.

Usage::

    from devicekit.memory.losses import resolve_loss

    loss_fn, name = resolve_loss("mse")          # loss_fn(output, sample) -> scalar
    loss_fn, name = resolve_loss(None)           # the assumed default: cross-entropy
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional

from devicekit.errors import InvalidValueError
from devicekit.memory.step import tensors

__all__ = ["LOSSES", "LossFn", "cross_entropy_loss", "mse_loss", "resolve_loss", "sum_loss"]

LossFn = Callable[[Any, Any], torch.Tensor]


def _outputs(output: Any) -> list[torch.Tensor]:
    found = [t for t in tensors(output) if t.is_floating_point() and t.requires_grad]
    if not found:
        raise InvalidValueError(
            "the model's output holds no floating tensor that needs a gradient, so there is no "
            "backward to size; pass training=False, or a loss_fn(output, sample)")
    return found


def _total(parts: list[torch.Tensor]) -> torch.Tensor:
    loss = parts[0]
    for part in parts[1:]:
        loss = loss + part
    return loss


def sum_loss(output: Any, sample: Any) -> torch.Tensor:
    """The sum of every floating output that needs a gradient (keeps nothing alive)."""
    return _total([t.sum() for t in _outputs(output)])


def cross_entropy_loss(output: Any, sample: Any) -> torch.Tensor:
    """Cross-entropy over the last dimension, against class-0 targets of the output's shape."""
    parts = []
    for t in _outputs(output):
        if t.dim() < 2:
            parts.append(t.sum())
            continue
        logits = t.reshape(-1, t.shape[-1])
        targets = torch.zeros(logits.shape[0], dtype=torch.long, device=t.device)
        parts.append(functional.cross_entropy(logits, targets))
    return _total(parts)


def mse_loss(output: Any, sample: Any) -> torch.Tensor:
    """Mean squared error against a zero target of the output's shape."""
    return _total([functional.mse_loss(t, torch.zeros_like(t)) for t in _outputs(output)])


#: loss name -> function (output, sample) -> scalar
LOSSES: dict[str, LossFn] = {"cross-entropy": cross_entropy_loss, "mse": mse_loss, "sum": sum_loss}


def resolve_loss(loss: str | LossFn | None) -> tuple[LossFn, str]:
    """(function, name for tables) for a loss name, a function, or None (cross-entropy assumed)."""
    if loss is None:
        return cross_entropy_loss, "cross-entropy (assumed)"
    if isinstance(loss, str):
        key = loss.lower().replace("_", "-")
        if key in ("ce", "crossentropy"):
            key = "cross-entropy"
        if key not in LOSSES:
            raise InvalidValueError(f"loss {loss!r} is unknown; use one of {', '.join(LOSSES)} "
                                    "or a function (output, sample) -> loss")
        return LOSSES[key], key
    if not callable(loss):
        raise InvalidValueError(f"loss_fn {loss!r} is neither a loss name nor a function")
    return loss, getattr(loss, "__name__", "custom")
