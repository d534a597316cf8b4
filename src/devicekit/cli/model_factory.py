"""Shared by ``devicekit estimate`` and ``advise``: load MODULE:FACTORY, parse --input shapes.

Usage::

    model = load_factory("mypkg.models:build_resnet")
    sample = parse_inputs("3x224x224,10:long", batch=64)   # (64,3,224,224) float, (64,10) long
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from devicekit.errors import InvalidValueError

__all__ = ["load_factory", "load_function", "parse_inputs"]

_DTYPES = {"float": "float32", "float32": "float32", "fp32": "float32", "bf16": "bfloat16",
           "bfloat16": "bfloat16", "fp16": "float16", "half": "float16", "float16": "float16",
           "double": "float64", "float64": "float64", "long": "int64", "int64": "int64",
           "int": "int32", "int32": "int32", "int16": "int16", "int8": "int8", "uint8": "uint8",
           "bool": "bool"}


def load_function(spec: str, what: str = "model", form: str = "MODULE:FACTORY") -> Any:
    """Import ``module:function`` (from the current directory too); the function, not called."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidValueError(f"{what} {spec!r} is not {form}, e.g. mypkg.models:build_resnet")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidValueError(f"{what} {spec!r}: cannot import {module_name!r} ({exc})") from None
    function = getattr(module, attr, None)
    if function is None or not callable(function):
        raise InvalidValueError(f"{what} {spec!r}: {module_name!r} has no callable {attr!r}")
    return function


def load_factory(spec: str) -> Any:
    """Import ``module:function`` (from the current directory too) and call it; the model."""
    from torch import nn

    factory = load_function(spec)
    try:
        model = factory()
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise InvalidValueError(f"model {spec!r}: the factory raised {type(exc).__name__}: {first}") from None
    if not isinstance(model, nn.Module):
        raise InvalidValueError(f"model {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def parse_inputs(text: str, batch: int) -> Any:
    """Meta tensors of shape (batch, *SHAPE) for each comma-separated ``AxBxC[:dtype]``."""
    import torch

    tensors = []
    for item in text.split(","):
        shape_text, _, dtype_text = item.strip().partition(":")
        try:
            shape = [int(d) for d in shape_text.lower().split("x")] if shape_text else []
        except ValueError:
            shape = []
        if not shape:
            raise InvalidValueError(f"--input {text!r}: shape {item.strip()!r} does not parse; write it like "
                                    "3x224x224 or 128:long (without the batch dimension), comma-separated")
        if any(d < 1 for d in shape):
            raise InvalidValueError(f"--input {text!r}: every dimension of {item.strip()!r} must be at least 1")
        dtype_name = _DTYPES.get(dtype_text.lower() or "float")
        if dtype_name is None:
            raise InvalidValueError(f"input dtype {dtype_text!r} is unknown; use one of {', '.join(_DTYPES)}")
        tensors.append(torch.empty(batch, *shape, dtype=getattr(torch, dtype_name), device="meta"))
    return tensors[0] if len(tensors) == 1 else tuple(tensors)
