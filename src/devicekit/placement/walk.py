"""Walking nested batches: one traversal that rebuilds every container kind around new leaves.

``to_device`` and ``pin_memory`` are both "do something to each tensor, keep everything else";
this module is the shared walk. A :class:`Walk` dispatches on the exact type of each object
through a dict (resolved once per type, then cached), keeps a memo from ``id(source)`` to result
so shared objects stay shared and self-containing lists terminate, and rebuilds containers with
their own type: dict, OrderedDict, defaultdict (its factory kept), other mappings; list, tuple,
namedtuple and their subclasses; dataclasses (frozen too; ``cached_property`` values computed
from the old fields are dropped, so they are recomputed from the moved ones). Tensors, modules and objects with a
``.to()``/``pin_memory()`` go to the walk's operations (an object whose ``.to()`` works in place
and returns None is kept, as Lightning's ``move_data_to_device`` does); everything else is returned as is.

Usage::

    from devicekit.placement.walk import Walk, iter_tensors

    double = Walk(None, lambda walk, t: t * 2, lambda walk, o: o, lambda walk, m: m, frozenset())
    double({"a": torch.ones(2), "b": [torch.ones(1), "text"]})
    list(iter_tensors(batch))          # each tensor once, modules' parameters and buffers too
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import numbers
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch
from torch import Tensor, nn

from devicekit.errors import PlacementError

__all__ = ["Walk", "iter_tensors", "map_tensors", "LEAF_TYPES"]

_MISSING = object()


class Walk:
    """One traversal: the target, the tensor operation, and the memo that keeps aliasing.

    A tensor already on ``device`` is kept as it is: ``tensor_op`` sees only the others (with
    ``device=None``, every tensor).
    """

    __slots__ = ("device", "tensor_op", "object_op", "module_op", "skip", "non_blocking", "memo")

    def __init__(
        self,
        device: torch.device | None,
        tensor_op: Callable[[Walk, Tensor], Tensor],
        object_op: Callable[[Walk, Any], Any],
        module_op: Callable[[Walk, nn.Module], nn.Module],
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

    def tensor(self, t: Tensor) -> Tensor:
        """``tensor_op(t)`` for a tensor not on the walk's device, once per tensor object (a
        tensor reached twice gives one result)."""
        memo = self.memo
        found = memo.get(id(t), _MISSING)
        if found is _MISSING:
            found = memo[id(t)] = self.tensor_op(self, t)
        return found

    def each(self, items: Any) -> list[Any]:
        """``[self(x) for x in items]``, with the common leaves taken without a dispatch: a
        plain tensor already on the target is kept, one elsewhere goes to :meth:`tensor`
        directly, numbers, strings and None are kept (the per-leaf cost of a batch)."""
        device, memo, op = self.device, self.memo, self.tensor_op
        return [(x if x.device == device else memo[k] if (k := id(x)) in memo
                 else memo.setdefault(k, op(self, x))) if type(x) is Tensor
                else x if type(x) in _PLAIN else self(x) for x in items]


# -- handlers: (walk, obj) -> new obj -------------------------------------------------------------


def _leaf(walk: Walk, obj: Any) -> Any:
    return obj


def _tensor(walk: Walk, obj: Tensor) -> Tensor:
    return obj if obj.device == walk.device else walk.tensor(obj)


def _module(walk: Walk, obj: nn.Module) -> nn.Module:
    if id(obj) not in walk.memo:
        walk.memo[id(obj)] = walk.module_op(walk, obj)
    return walk.memo[id(obj)]


def _custom(walk: Walk, obj: Any) -> Any:
    found = walk.memo.get(id(obj), _MISSING)
    if found is _MISSING:
        found = walk.object_op(walk, obj)
        walk.memo[id(obj)] = found
    return found


def _list(walk: Walk, obj: list[Any]) -> list[Any]:
    memo = walk.memo
    found = memo.get(id(obj))
    if found is not None:
        return found
    out: list[Any] = []
    memo[id(obj)] = out  # registered before the items: a list that holds itself works
    out += walk.each(obj)
    return out


def _tuple(walk: Walk, obj: tuple[Any, ...]) -> tuple[Any, ...]:
    found = walk.memo.get(id(obj))
    if found is not None:
        return found
    out = tuple(walk.each(obj))
    walk.memo[id(obj)] = out
    return out


def _dict(walk: Walk, obj: dict[Any, Any]) -> dict[Any, Any]:
    memo = walk.memo
    found = memo.get(id(obj))
    if found is not None:
        return found
    out: dict[Any, Any] = {}
    memo[id(obj)] = out
    skip = walk.skip
    if skip:
        out.update({k: v if k in skip else walk(v) for k, v in obj.items()})
    else:
        out.update(zip(obj.keys(), walk.each(obj.values()), strict=True))
    return out


def _mapping(walk: Walk, obj: Mapping[Any, Any]) -> Any:
    """OrderedDict, defaultdict, Counter, UserDict, other mappings: same type, same extras."""
    found = walk.memo.get(id(obj))
    if found is not None:
        return found
    skip = walk.skip
    if isinstance(obj, MutableMapping):
        out = copy.copy(obj)  # keeps default_factory, order and instance attributes
        walk.memo[id(obj)] = out
        changed: dict[Any, Any] = {}
        for k, v in obj.items():
            if k not in skip:
                new = walk(v)
                if new is not v:
                    changed[k] = new
        try:
            for k, new in changed.items():
                out[k] = new
        except TypeError:  # an immutable mapping (torch.fx's immutable_dict, node kwargs): build anew
            try:
                out = type(obj)({**obj, **changed})
            except TypeError:
                out = {**obj, **changed}
            walk.memo[id(obj)] = out
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


def _namedtuple(walk: Walk, obj: Any) -> Any:
    found = walk.memo.get(id(obj))
    if found is None:
        found = type(obj)._make(walk.each(obj))
        walk.memo[id(obj)] = found
    return found


def _tuple_subclass(walk: Walk, obj: tuple[Any, ...]) -> Any:
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


def _list_subclass(walk: Walk, obj: list[Any]) -> Any:
    found = walk.memo.get(id(obj))
    if found is None:
        found = copy.copy(obj)  # keeps the subclass and its attributes
        walk.memo[id(obj)] = found
        items = [walk(x) for x in obj]
        try:
            found[:] = items
        except TypeError:  # an immutable list (torch.fx's immutable_list, node args): build anew
            try:
                found = type(obj)(items)
            except TypeError:
                found = items
            walk.memo[id(obj)] = found
    return found


def _dataclass(walk: Walk, obj: Any) -> Any:
    """A shallow copy with moved fields; works for frozen, slotted and init=False fields."""
    found = walk.memo.get(id(obj))
    if found is not None:
        return found
    out = copy.copy(obj)
    walk.memo[id(obj)] = out
    changed = False
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name, _MISSING)
        if value is _MISSING:
            continue
        new = walk(value)
        if new is not value:
            object.__setattr__(out, field.name, new)
            changed = True
    if changed:
        _forget_cached_properties(out)
    return out


def _forget_cached_properties(obj: Any) -> None:
    """Drop ``functools.cached_property`` values computed from the old fields (recomputed on use)."""
    state = getattr(obj, "__dict__", None)
    if not state:
        return
    for name in _cached_property_names(type(obj)):
        state.pop(name, None)


def _cached_property_names(cls: type) -> tuple[str, ...]:
    found = _CACHED_NAMES.get(cls)
    if found is None:
        found = tuple(name for klass in cls.__mro__ for name, attr in vars(klass).items()
                      if isinstance(attr, functools.cached_property))
        _CACHED_NAMES[cls] = found
    return found


_CACHED_NAMES: dict[type, tuple[str, ...]] = {}


_HANDLERS: dict[type, Callable[[Walk, Any], Any]] = {
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
LEAF_TYPES = (str, bytes, bytearray, numbers.Number, enum.Enum, type, torch.Size)
_PLAIN = frozenset({int, float, str, bool, type(None)})  # taken without a dispatch by Walk.each


def _resolve(cls: type) -> Callable[[Walk, Any], Any]:
    """The handler for a type not seen before, cached by type."""
    if issubclass(cls, Tensor):
        handler = _tensor
    elif issubclass(cls, nn.Module):
        handler = _module
    elif issubclass(cls, LEAF_TYPES):
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
        elif isinstance(item, LEAF_TYPES) or item is None:
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


def map_tensors(obj: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``obj`` rebuilt with ``fn(t)`` for every tensor ``t`` in it, every container of its own type
    (namedtuples, dataclasses, defaultdicts, ...), shared tensors mapped once; modules and other
    objects are kept as they are. The one tree map of the package (micro-batches, estimates and
    layer profiles use it, so every structure ``to_device`` keeps is kept there too)."""
    return Walk(None, lambda walk, t: fn(t), _keep_object, _keep_module, frozenset())(obj)


def _keep_object(walk: Walk, obj: Any) -> Any:
    return obj


def _keep_module(walk: Walk, module: nn.Module) -> nn.Module:
    return module
