"""Moving whole batches: ``to_device``, ``pin_memory`` and ``device_of`` for nested structures.

A batch is whatever a data loader or model produces: tensors; modules; dict, OrderedDict,
defaultdict and other mappings; lists, tuples, namedtuples and tuple subclasses; dataclasses
(frozen ones too); objects with their own ``.to()``; anything else is returned as is. Containers
are rebuilt with their own type (a defaultdict keeps its factory); modules move in place and are
returned; a tensor reached twice comes out as one moved tensor (aliasing is kept); tensors
already on the target device are returned untouched, without a ``.to()`` call.

``non_blocking=None`` copies asynchronously only where that is safe and useful (pinned host
memory to CUDA); ``True``/``False`` force it.

Usage::

    import devicekit as dk

    batch = {"image": images, "label": labels, "meta": {"ids": [1, 2]}}
    batch = dk.to_device(batch, "cuda:0")                 # structure and types kept
    batch = dk.to_device(batch, "cuda", skip_keys={"meta"})
    dk.device_of(model)                                   # PlacementError if spread over devices
    pinned = dk.pin_memory(batch)                         # for fast non_blocking copies
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import numbers
from collections.abc import Callable, Collection, Iterator, Mapping, MutableMapping
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from devicekit.errors import PlacementError
from devicekit.placement.devices import DeviceLike, accelerator_type, as_device

__all__ = ["to_device", "pin_memory", "device_of", "iter_tensors"]

T = TypeVar("T")
_MISSING = object()


class _Walk:
    """One traversal: the target, the tensor operation, and the memo that keeps aliasing."""

    __slots__ = ("device", "tensor_op", "object_op", "module_op", "skip", "non_blocking", "memo")

    def __init__(
        self,
        device: torch.device | None,
        tensor_op: Callable[[_Walk, Tensor], Tensor],
        object_op: Callable[[_Walk, Any], Any],
        module_op: Callable[[_Walk, nn.Module], nn.Module],
        skip: frozenset[Any],
        non_blocking: bool | None = None,
    ) -> None:
        self.device = device
        self.tensor_op = tensor_op
        self.object_op = object_op
        self.module_op = module_op
        self.skip = skip
        self.non_blocking = non_blocking
        self.memo: dict[int, Any] = {}

    def __call__(self, obj: Any) -> Any:
        handler = _HANDLERS.get(type(obj))
        if handler is None:
            handler = _resolve(type(obj))
        return handler(self, obj)


# -- handlers: (walk, obj) -> new obj -------------------------------------------------------------


def _leaf(walk: _Walk, obj: Any) -> Any:
    return obj


def _tensor(walk: _Walk, obj: Tensor) -> Tensor:
    found = walk.memo.get(id(obj), _MISSING)
    if found is _MISSING:
        found = walk.tensor_op(walk, obj)
        walk.memo[id(obj)] = found
    return found


def _module(walk: _Walk, obj: nn.Module) -> nn.Module:
    if id(obj) not in walk.memo:
        walk.memo[id(obj)] = walk.module_op(walk, obj)
    return walk.memo[id(obj)]


def _custom(walk: _Walk, obj: Any) -> Any:
    found = walk.memo.get(id(obj), _MISSING)
    if found is _MISSING:
        found = walk.object_op(walk, obj)
        walk.memo[id(obj)] = found
    return found


def _list(walk: _Walk, obj: list[Any]) -> list[Any]:
    memo = walk.memo
    found = memo.get(id(obj))
    if found is not None:
        return found
    out: list[Any] = []
    memo[id(obj)] = out  # registered before the items: a list that holds itself works
    device = walk.device
    out += [x if type(x) is Tensor and x.device == device else walk(x) for x in obj]
    return out


def _tuple(walk: _Walk, obj: tuple[Any, ...]) -> tuple[Any, ...]:
    found = walk.memo.get(id(obj))
    if found is not None:
        return found
    device = walk.device
    out = tuple([x if type(x) is Tensor and x.device == device else walk(x) for x in obj])
    walk.memo[id(obj)] = out
    return out


def _dict(walk: _Walk, obj: dict[Any, Any]) -> dict[Any, Any]:
    memo = walk.memo
    found = memo.get(id(obj))
    if found is not None:
        return found
    out: dict[Any, Any] = {}
    memo[id(obj)] = out
    device, skip = walk.device, walk.skip
    if skip:
        out.update({k: v if k in skip else walk(v) for k, v in obj.items()})
    else:
        out.update(
            {
                k: v if type(v) is Tensor and v.device == device else walk(v)
                for k, v in obj.items()
            }
        )
    return out


def _mapping(walk: _Walk, obj: Mapping[Any, Any]) -> Any:
    """OrderedDict, defaultdict, Counter, UserDict, other mappings: same type, same extras."""
    found = walk.memo.get(id(obj))
    if found is not None:
        return found
    skip = walk.skip
    if isinstance(obj, MutableMapping):
        out = copy.copy(obj)  # keeps default_factory, order and instance attributes
        walk.memo[id(obj)] = out
        for k, v in obj.items():
            if k not in skip:
                new = walk(v)
                if new is not v:
                    out[k] = new
        return out
    items = {k: v if k in skip else walk(v) for k, v in obj.items()}
    try:
        out = type(obj)(items)
    except TypeError as err:
        raise PlacementError(
            f"cannot rebuild mapping of type {type(obj).__qualname__} from a dict ({err}); "
            "give it a .to(device) method or pass a dict"
        ) from None
    walk.memo[id(obj)] = out
    return out


def _namedtuple(walk: _Walk, obj: Any) -> Any:
    found = walk.memo.get(id(obj))
    if found is None:
        device = walk.device
        found = type(obj)._make(
            [x if type(x) is Tensor and x.device == device else walk(x) for x in obj]
        )
        walk.memo[id(obj)] = found
    return found


def _tuple_subclass(walk: _Walk, obj: tuple[Any, ...]) -> Any:
    found = walk.memo.get(id(obj))
    if found is None:
        try:
            found = type(obj)([walk(x) for x in obj])
        except TypeError as err:
            raise PlacementError(
                f"cannot rebuild tuple subclass {type(obj).__qualname__} from its items ({err}); "
                "make it a namedtuple or give it a .to(device) method"
            ) from None
        walk.memo[id(obj)] = found
    return found


def _list_subclass(walk: _Walk, obj: list[Any]) -> Any:
    found = walk.memo.get(id(obj))
    if found is None:
        found = copy.copy(obj)  # keeps the subclass and its attributes
        walk.memo[id(obj)] = found
        found[:] = [walk(x) for x in obj]
    return found


def _dataclass(walk: _Walk, obj: Any) -> Any:
    """A shallow copy with moved fields; works for frozen, slotted and init=False fields."""
    found = walk.memo.get(id(obj))
    if found is not None:
        return found
    out = copy.copy(obj)
    walk.memo[id(obj)] = out
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name, _MISSING)
        if value is _MISSING:
            continue
        new = walk(value)
        if new is not value:
            object.__setattr__(out, field.name, new)
    return out


_HANDLERS: dict[type, Callable[[_Walk, Any], Any]] = {
    Tensor: _tensor,
    nn.Parameter: _tensor,
    list: _list,
    tuple: _tuple,
    dict: _dict,
    torch.Size: _leaf,
    torch.device: _leaf,
    torch.dtype: _leaf,
    type(None): _leaf,
    bool: _leaf,
    int: _leaf,
    float: _leaf,
    complex: _leaf,
    str: _leaf,
    bytes: _leaf,
    bytearray: _leaf,
    range: _leaf,
    slice: _leaf,
    type(Ellipsis): _leaf,
}
_LEAF_TYPES = (str, bytes, bytearray, numbers.Number, enum.Enum, type, torch.Size)


def _resolve(cls: type) -> Callable[[_Walk, Any], Any]:
    """The handler for a type not seen before, cached by type."""
    if issubclass(cls, Tensor):
        handler = _tensor
    elif issubclass(cls, nn.Module):
        handler = _module
    elif issubclass(cls, _LEAF_TYPES):
        handler = _leaf
    elif callable(getattr(cls, "to", None)) or callable(getattr(cls, "pin_memory", None)):
        handler = _custom
    elif issubclass(cls, dict) or issubclass(cls, Mapping):
        handler = _mapping
    elif issubclass(cls, tuple):
        handler = _namedtuple if hasattr(cls, "_fields") and hasattr(cls, "_make") else _tuple_subclass
    elif issubclass(cls, list):
        handler = _list_subclass
    elif dataclasses.is_dataclass(cls):
        handler = _dataclass
    else:
        handler = _leaf
    if len(_HANDLERS) < 4096:
        _HANDLERS[cls] = handler
    return handler


# -- to_device ------------------------------------------------------------------------------------


def _move_tensor(walk: _Walk, t: Tensor) -> Tensor:
    device = walk.device
    if t.device == device:
        return t
    asynchronous = walk.non_blocking
    if asynchronous is None:  # safe and useful only from pinned host memory to CUDA
        asynchronous = device.type == "cuda" and t.device.type == "cpu" and t.is_pinned()
    return t.to(device, non_blocking=asynchronous)


def _move_module(walk: _Walk, module: nn.Module) -> nn.Module:
    module.to(walk.device, non_blocking=bool(walk.non_blocking))
    return module


def _move_object(walk: _Walk, obj: Any) -> Any:
    to = getattr(obj, "to", None)
    if not callable(to):
        return obj  # it only has pin_memory()
    if not walk.non_blocking:
        return to(walk.device)
    try:
        return to(walk.device, non_blocking=True)
    except TypeError as err:  # a .to() that does not take non_blocking
        if "non_blocking" not in str(err):
            raise
        return to(walk.device)


def to_device(
    obj: T,
    device: DeviceLike,
    *,
    non_blocking: bool | None = None,
    skip_keys: str | Collection[Any] | None = None,
) -> T:
    """``obj`` with every tensor (and module, and ``.to()``-able object) on ``device``.

    ``skip_keys``: mapping keys (at any depth) whose values stay where they are.
    ``non_blocking``: None = async only for pinned host memory to CUDA; True/False force it.
    """
    target = as_device(device)
    if skip_keys is None:
        skip: frozenset[Any] = frozenset()
    elif isinstance(skip_keys, (str, bytes)) or not isinstance(skip_keys, Collection):
        skip = frozenset([skip_keys])
    else:
        skip = frozenset(skip_keys)
    if type(obj) is Tensor and obj.device == target:  # the commonest call: nothing to do
        return obj
    walk = _Walk(target, _move_tensor, _move_object, _move_module, skip, non_blocking)
    return walk(obj)


# -- pin_memory -----------------------------------------------------------------------------------


def _pin_tensor(walk: _Walk, t: Tensor) -> Tensor:
    if t.device.type != "cpu" or t.is_pinned():
        return t
    return t.pin_memory()


def _pin_object(walk: _Walk, obj: Any) -> Any:
    pin = getattr(obj, "pin_memory", None)
    return pin() if callable(pin) else obj


def _keep_module(walk: _Walk, module: nn.Module) -> nn.Module:
    return module


def pin_memory(obj: T) -> T:
    """``obj`` with its CPU tensors in page-locked memory (for fast ``non_blocking`` copies).

    Modules and non-CPU tensors are left as they are. Without an accelerator there is no pinned
    memory, so ``obj`` is returned unchanged.
    """
    if accelerator_type() is None:
        return obj
    walk = _Walk(None, _pin_tensor, _pin_object, _keep_module, frozenset())
    return walk(obj)


# -- device_of ------------------------------------------------------------------------------------


def iter_tensors(obj: Any) -> Iterator[Tensor]:
    """Every tensor in ``obj`` (a tensor, module, or nested batch), each once."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        if isinstance(item, Tensor):
            seen.add(id(item))
            yield item
        elif isinstance(item, nn.Module):
            seen.add(id(item))
            stack.extend(item.parameters())
            stack.extend(item.buffers())
        elif isinstance(item, _LEAF_TYPES) or item is None:
            continue
        elif isinstance(item, Mapping):
            seen.add(id(item))
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            seen.add(id(item))
            stack.extend(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            seen.add(id(item))
            stack.extend(getattr(item, f.name, None) for f in dataclasses.fields(item))


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
