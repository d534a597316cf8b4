"""How a sample batch is passed to a model: one positional input, or keyword arguments.

Hugging Face models are called with keyword batches (``model(**batch)``: ``input_ids``,
``attention_mask``, ``labels``, ``pixel_values``), most torch models with one input. A ``sample``
given to ``dk.split``, ``dk.plan_devices`` or ``dk.Pipeline`` is passed the way the model would
be called:

* a :class:`Call` (``Call(x, mask=m)``) is passed as it says: positional and keyword arguments;
* a dict (any ``Mapping``, such as a tokenizer's ``BatchEncoding``) whose keys are names of the
  forward's parameters (or, for a forward that takes ``**kwargs``, include one of them), and
  which holds every parameter the forward needs (those without a default), is passed as
  keywords: ``model(**sample)``;
* anything else (a tensor, a tuple, a dict the forward takes as one argument) is the first
  positional input: ``model(sample)``.

Usage::

    from devicekit.modelparallel.call_args import Call, as_call

    args, kwargs = as_call(hf_model, {"input_ids": ids, "labels": ids})   # ((), {...})
    args, kwargs = as_call(net, x)                                        # ((x,), {})
    args, kwargs = as_call(net, Call(x, mask=m))                          # ((x,), {"mask": m})
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["Call", "as_call", "takes_keywords"]


class Call:
    """Positional and keyword arguments for one call of a model: ``Call(x, mask=m)``."""

    __slots__ = ("args", "kwargs")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"Call({len(self.args)} positional, keywords {sorted(self.kwargs)})"


def takes_keywords(model: nn.Module, sample: Mapping[Any, Any]) -> bool:
    """True when ``sample`` (a mapping) is ``model``'s keyword arguments rather than its first input."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    needed = {n for n, p in params.items()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is inspect.Parameter.empty}
    keys = set(sample.keys())
    if not keys or not all(isinstance(k, str) for k in keys):
        return False
    open_ended = any(p.kind == p.VAR_KEYWORD for p in params.values())  # forward(self, input_ids, **kwargs)
    return (open_ended or keys <= named) and needed <= keys and bool(keys & named)


def as_call(model: nn.Module, sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` to call ``model`` with ``sample`` (see the module doc)."""
    if isinstance(sample, Call):
        return sample.args, dict(sample.kwargs)
    if isinstance(sample, Mapping) and takes_keywords(model, sample):
        return (), dict(sample)
    return (sample,), {}
