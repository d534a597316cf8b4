"""Shared by ``devicekit estimate`` and ``advise``: load MODULE:FACTORY, parse --input shapes.

Usage::

    check_model_args("mypkg.models:build_resnet", "3x224x224")  # before torch is imported
    model = load_factory("mypkg.models:build_resnet")
    sample = parse_inputs("3x224x224,10:long", batch=64)   # (64,3,224,224) float, (64,10) long
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

from devicekit.errors import InvalidValueError

__all__ = ["check_model_args", "input_specs", "load_factory", "load_function", "parse_inputs"]

_DTYPES = {"float": "float32", "float32": "float32", "fp32": "float32", "bf16": "bfloat16",
           "bfloat16": "bfloat16", "fp16": "float16", "half": "float16", "float16": "float16",
           "double": "float64", "float64": "float64", "long": "int64", "int64": "int64",
           "int": "int32", "int32": "int32", "int16": "int16", "int8": "int8", "uint8": "uint8",
           "bool": "bool"}


def check_model_args(model_spec: str, inputs: str) -> None:
    """The model's MODULE:FACTORY and the --input shapes, checked before torch is imported (a
    wrong argument is told at once, not after torch's seconds of import)."""
    module_name, _ = _split(model_spec, "model", "MODULE:FACTORY")
    input_specs(inputs)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        missing = importlib.util.find_spec(module_name) is None
    except (ImportError, ValueError):   # a parent package that fails to import: load_function says why
        missing = False
    if missing:
        raise InvalidValueError(f"model {model_spec!r}: cannot import {module_name!r} "
                                f"(No module named {module_name!r})")


def _split(spec: str, what: str, form: str) -> tuple[str, str]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidValueError(f"{what} {spec!r} is not {form}, e.g. mypkg.models:build_resnet")
    if module_name.endswith(".py") or "/" in module_name:  # a file path: said as such, not "No module named"
        folder, _, file = module_name.rpartition("/")
        stem = file[:-3] if file.endswith(".py") else file
        where = f"from {folder or '/'}" if folder else "from its folder"
        raise InvalidValueError(
            f"{what} {spec!r}: {module_name!r} is a file path, but MODULE is a module name importable"
            f" from here: run {where} with '{stem}:{attr}' (or put the folder on PYTHONPATH)")
    return module_name, attr


def load_function(spec: str, what: str = "model", form: str = "MODULE:FACTORY") -> Any:
    """Import ``module:function`` (from the current directory too); the function, not called."""
    module_name, attr = _split(spec, what, form)
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


def input_specs(text: str) -> list[tuple[list[int], str]]:
    """(shape, torch dtype name) for each comma-separated ``AxBxC[:dtype]``; no torch needed."""
    specs = []
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
        specs.append((shape, dtype_name))
    return specs


def parse_inputs(text: str, batch: int) -> Any:
    """Meta tensors of shape (batch, *SHAPE) for each comma-separated ``AxBxC[:dtype]``."""
    import torch

    tensors = []
    for shape, dtype_name in input_specs(text):
        try:
            tensors.append(torch.empty(batch, *shape, dtype=getattr(torch, dtype_name), device="meta"))
        except (RuntimeError, OverflowError, TypeError):  # no tensor that large: a size past int64
            dims = "x".join(str(d) for d in shape)
            raise InvalidValueError(f"--input {text!r}: {dims} at batch {batch} is too large for any "
                                    "tensor (its size in bytes overflows); check the shape") from None
    return tensors[0] if len(tensors) == 1 else tuple(tensors)
