"""Random draws that decide whether a layer runs, drawn so that every layer runs.

LayerDrop and stochastic depth skip a layer when one random number falls below a rate:
``if torch.rand([]) < config.layerdrop: continue`` (Wav2Vec2, HuBERT and other transformers
models in training). Memory must hold the step in which no layer is skipped, and a fake tensor
has no value to compare, so a single random number (``torch.rand([])``, ``torch.rand(1)``)
is drawn as the largest float below 1, a constant that fake tensors can compare: no layer is
skipped, on fake tensors and in the real CPU steps that stand in for them alike. Larger draws
(dropout masks) are untouched.

Usage::

    from devicekit.memory.draws import layer_kept_draw

    out = layer_kept_draw(func, args, kwargs)        # inside a dispatch mode
    if out is None:
        out = func(*args, **kwargs)
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["layer_kept_draw"]

_DRAWS = {torch.ops.aten.rand.default, torch.ops.aten.rand.generator}
_BELOW_ONE = 1.0 - 2.0 ** -24     # the largest float32 below 1


def layer_kept_draw(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """A constant just below 1 for a one-number ``torch.rand``; None for any other op."""
    if func not in _DRAWS or math.prod(args[0]) != 1:
        return None
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    # made inside the caller's dispatch mode: under fake tensors this is a constant fake tensor,
    # which comparisons evaluate
    draw = torch.tensor(_BELOW_ONE, dtype=dtype, device=kwargs.get("device"))
    return draw.reshape(list(args[0]))
