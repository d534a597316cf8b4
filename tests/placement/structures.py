"""Every kind of batch ``to_device`` promises to handle, and a checker that compares results."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

Point = namedtuple("Point", "x y")


class Shape(tuple):
    """A tuple subclass that is not a namedtuple."""


class Tagged(list):
    """A list subclass carrying an attribute."""

    tag = "plain"


class ReadOnly(Mapping):
    """An immutable Mapping built from a dict."""

    def __init__(self, data: dict[Any, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


@dataclasses.dataclass
class Sample:
    value: Any
    label: Any = None


@dataclasses.dataclass(frozen=True)
class FrozenSample:
    value: Any
    note: str = "frozen"


class Movable:
    """Not a container: only knows how to move itself with ``.to()``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.moved_to: torch.device | None = None

    def to(self, device: Any) -> Movable:
        out = Movable(self.tensor.to(device))
        out.moved_to = torch.device(device)
        return out


def check_moved(src: Any, out: Any, target: torch.device, pairs: dict[int, Any]) -> None:
    """Assert ``out`` is ``src`` moved to ``target``: same structure, types, leaves, aliasing.

    ``pairs`` maps id(source tensor) -> moved tensor across the whole structure.
    """
    if isinstance(src, torch.Tensor):
        assert isinstance(out, torch.Tensor)
        assert out.device == target
        assert out.shape == src.shape and out.dtype == src.dtype
        if src.device == target:
            assert out is src  # already there: untouched, no copy
        elif target.type != "meta":
            assert torch.equal(out.cpu(), src.cpu())
        if id(src) in pairs:
            assert pairs[id(src)] is out  # the same tensor twice comes out as one tensor
        pairs[id(src)] = out
        return
    if isinstance(src, nn.Module):
        assert out is src
        assert all(p.device == target for p in out.parameters())
        return
    if isinstance(src, Movable):
        assert isinstance(out, Movable) and out.moved_to == target
        assert out.tensor.device == target
        return
    assert type(out) is type(src), (type(out), type(src))
    if isinstance(src, Mapping):
        assert list(out.keys()) == list(src.keys())
        if isinstance(src, defaultdict):
            assert out.default_factory is src.default_factory
        for key in src:
            check_moved(src[key], out[key], target, pairs)
        return
    if isinstance(src, (list, tuple)):
        assert len(out) == len(src)
        if isinstance(src, Tagged):
            assert out.tag == src.tag
        for a, b in zip(src, out, strict=True):
            check_moved(a, b, target, pairs)
        return
    if dataclasses.is_dataclass(src):
        for field in dataclasses.fields(src):
            check_moved(getattr(src, field.name), getattr(out, field.name), target, pairs)
        return
    assert out is src  # strings, numbers, None: returned as they are


def make_container(kind: str, items: list[Any]) -> Any:
    """Build a container of ``kind`` holding ``items``."""
    keyed = {f"k{i}": v for i, v in enumerate(items)}
    if kind == "list":
        return list(items)
    if kind == "tuple":
        return tuple(items)
    if kind == "dict":
        return keyed
    if kind == "ordereddict":
        return OrderedDict(reversed(list(keyed.items())))
    if kind == "defaultdict":
        return defaultdict(list, keyed)
    if kind == "userdict":
        return UserDict(keyed)
    if kind == "readonly":
        return ReadOnly(keyed)
    if kind == "namedtuple":
        return Point(items[0] if items else None, items[1:] or None)
    if kind == "shape":
        return Shape(items)
    if kind == "tagged":
        out = Tagged(items)
        out.tag = "custom"
        return out
    if kind == "dataclass":
        return Sample(items, items[0] if items else None)
    if kind == "frozen":
        return FrozenSample(tuple(items))
    raise AssertionError(kind)


CONTAINER_KINDS = ["list", "tuple", "dict", "ordereddict", "defaultdict", "userdict", "readonly",
                   "namedtuple", "shape", "tagged", "dataclass", "frozen"]
