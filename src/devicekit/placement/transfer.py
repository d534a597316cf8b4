"""Moving whole batches: ``to_device``, ``pin_memory`` and ``device_of`` for nested structures.

A batch is whatever a data loader or model produces: tensors; modules; dict, OrderedDict,
defaultdict and other mappings; lists, tuples, namedtuples and tuple subclasses; dataclasses
(frozen ones too); objects with their own ``.to()``; anything else is returned as is. Containers
are rebuilt with their own type (a defaultdict keeps its factory); modules move in place and are
returned; a tensor reached twice comes out as one moved tensor (aliasing is kept); tensors
already on the target device are returned untouched, without a ``.to()`` call.

``non_blocking=None`` copies tensors asynchronously where that is safe: to a CUDA device
(from pinned host memory the copy overlaps the host's work; from pageable memory CUDA stages
the data before the call returns, so the source may change at once; either way the copy is
ordered before later work on the device's current stream, and another stream must
``wait_stream`` first). Copies to the host block, since the host reads them next. Whether a
host tensor is pinned is never asked per tensor (``is_pinned()`` costs CUDA driver calls).
Modules and ``.to()`` objects move blocking unless ``non_blocking=True``; ``True``/``False``
force it for everything.

Usage::

    import devicekit as dk

    batch = {"image": images, "label": labels, "meta": {"ids": [1, 2]}}
    batch = dk.to_device(batch, "cuda:0")                 # structure and types kept
    batch = dk.to_device(batch, "cuda", skip_keys={"meta"})
    dk.device_of(model)                                   # PlacementError if spread over devices
    pinned = dk.pin_memory(batch)                         # for fast non_blocking copies
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from devicekit.errors import InvalidValueError, PlacementError
from devicekit.placement.devices import DeviceLike, accelerator_type, as_device
from devicekit.placement.walk import Walk, iter_tensors

__all__ = ["to_device", "pin_memory", "device_of", "iter_tensors"]

T = TypeVar("T")


# -- to_device ------------------------------------------------------------------------------------


def _move_tensor(walk: Walk, t: Tensor) -> Tensor:
    """A blocking copy (the walk hands over only tensors not on its device yet)."""
    return t.to(walk.device)


def _move_tensor_async(walk: Walk, t: Tensor) -> Tensor:
    """An asynchronous copy, ordered on the target device's current stream."""
    return t.to(walk.device, non_blocking=True)


def _move_module(walk: Walk, module: nn.Module) -> nn.Module:
    module.to(walk.device, non_blocking=bool(walk.non_blocking))
    return module


def _move_object(walk: Walk, obj: Any) -> Any:
    """``obj.to(device)``; an object whose ``.to()`` works in place (returns None) is kept."""
    to = getattr(obj, "to", None)
    if not callable(to):
        return obj  # it only has pin_memory()
    if not walk.non_blocking:
        moved = to(walk.device)
    else:
        try:
            moved = to(walk.device, non_blocking=True)
        except TypeError as err:  # a .to() that does not take non_blocking
            if "non_blocking" not in str(err):
                raise
            moved = to(walk.device)
    return obj if moved is None else moved


def to_device(
    obj: T,
    device: DeviceLike,
    *,
    non_blocking: bool | None = None,
    skip_keys: str | Collection[Any] | None = None,
) -> T:
    """``obj`` with every tensor (and module, and ``.to()``-able object) on ``device``.

    ``skip_keys``: mapping keys (at any depth) whose values stay where they are.
    ``non_blocking``: None = tensors copy asynchronously to CUDA devices, blocking to the host
    (see the module doc); True/False force it for tensors, modules and objects alike.
    """
    target = as_device(device)
    if skip_keys is None:
        skip: frozenset[Any] = frozenset()
    elif isinstance(skip_keys, (str, bytes)) or not isinstance(skip_keys, Collection):
        skip = frozenset([skip_keys])
    else:
        try:
            skip = frozenset(skip_keys)
        except TypeError:  # e.g. skip_keys=[["meta"]]: keys must be hashable like dict keys
            raise InvalidValueError(
                f"skip_keys={skip_keys!r} holds an unhashable item; pass mapping keys, "
                "e.g. skip_keys={'meta'}"
            ) from None
    if type(obj) is Tensor and obj.device == target:  # the commonest call: nothing to do
        return obj
    asynchronous = target.type == "cuda" if non_blocking is None else bool(non_blocking)
    walk = Walk(target, _move_tensor_async if asynchronous else _move_tensor, _move_object,
                _move_module, skip, non_blocking)
    return walk(obj)


# -- pin_memory -----------------------------------------------------------------------------------


def _pin_tensor(walk: Walk, t: Tensor) -> Tensor:
    if t.device.type != "cpu" or t.is_pinned():
        return t
    return t.pin_memory()


def _pin_object(walk: Walk, obj: Any) -> Any:
    pin = getattr(obj, "pin_memory", None)
    pinned = pin() if callable(pin) else None
    return obj if pinned is None else pinned


def _keep_module(walk: Walk, module: nn.Module) -> nn.Module:
    return module


def pin_memory(obj: T) -> T:
    """``obj`` with its CPU tensors in page-locked memory (for fast ``non_blocking`` copies).

    Modules and non-CPU tensors are left as they are. Without an accelerator there is no pinned
    memory, so ``obj`` is returned unchanged.
    """
    if accelerator_type() is None:
        return obj
    walk = Walk(None, _pin_tensor, _pin_object, _keep_module, frozenset())
    return walk(obj)


# -- device_of ------------------------------------------------------------------------------------


def device_of(obj: Any) -> torch.device:
    """The one device that ``obj``'s tensors (a module's parameters and buffers) live on.

    Raises :class:`PlacementError` naming the devices when they are spread over several, and
    when ``obj`` holds no tensor at all.
    """
    if isinstance(obj, Tensor):
        return obj.device
    devices: dict[str, torch.device] = {}
    for t in iter_tensors(obj):
        devices.setdefault(str(t.device), t.device)
    what = f"module {type(obj).__name__}" if isinstance(obj, nn.Module) else type(obj).__name__
    if not devices:
        raise PlacementError(
            f"{what} holds no tensors, so it has no device; "
            "pass a tensor, a module with parameters, or a batch"
        )
    if len(devices) > 1:
        names = ", ".join(sorted(devices))
        raise PlacementError(
            f"{what} is spread over {len(devices)} devices ({names}); "
            "ask about one part, or move it all with devicekit.to_device(obj, device)"
        )
    return next(iter(devices.values()))
