"""Attribute paths: walk from a named variable to what it holds, naming each step.

``walk("model", model)`` yields ``model.history``, ``model.encoder.cache``, ``stats['losses']``
and (with ``list_items``) ``self.history[3]``: the names a person would type to reach a tensor or
a container. Each :class:`Found` keeps the steps, so :func:`resolve` re-reads the same path later
without walking again. Parameters and buffers are left to the module index
(:mod:`devicekit.memory.census`), optimizer state below ``optimizer.state`` too.

Usage::

    from devicekit.memory.paths import walk, resolve

    for found in walk("model", model, max_depth=2):
        print(found.path, type(found.value).__name__, found.in_module)
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from devicekit.memory.roots import MISSING, is_plain_value

__all__ = ["Found", "walk", "resolve", "MODULE_INTERNALS", "CONTAINERS"]

#: attributes every nn.Module has; never holders
MODULE_INTERNALS = frozenset(vars(torch.nn.Module()).keys()) | {"training"}
#: containers whose growth the leak finder measures
CONTAINERS = (list, dict, set, collections.deque)
_KEY_TYPES = (str, int, float, bool)


@dataclass(frozen=True)
class Found:
    """A value reached from a root; ``in_module``: it is a non-parameter attribute of a module."""

    path: str
    value: Any
    steps: tuple[tuple[str, Any], ...]
    in_module: bool


def _key_text(key: Any) -> str | None:
    if isinstance(key, str):
        return repr(key)
    if isinstance(key, _KEY_TYPES):
        return str(key)
    return None


def walk(
    name: str, value: Any, *, max_depth: int = 2, list_items: bool = False, max_items: int = 10_000
) -> Iterator[Found]:
    """Yield ``name`` itself and everything reachable within ``max_depth`` named steps."""
    seen: set[int] = set()
    yield from _walk(Found(name, value, (), False), 0, max_depth, list_items, max_items, seen)


def _walk(
    found: Found, depth: int, max_depth: int, list_items: bool, max_items: int, seen: set[int]
) -> Iterator[Found]:
    value = found.value
    if id(value) in seen or is_plain_value(value):
        return
    cls = type(value)  # not isinstance: it reads __class__, which a dead weak proxy raises on
    seen.add(id(value))
    yield found
    if issubclass(cls, torch.Tensor):
        return
    children: list[tuple[Found, int]] = []
    if issubclass(cls, torch.nn.Module):
        for key, attr in vars(value).items():
            if key in MODULE_INTERNALS or key.startswith("__"):
                continue
            children.append((_child(found, f".{key}", ("attr", key), attr, True), depth + 1))
        for key, child in value._modules.items():
            if child is not None:  # submodules cost no depth: a model is a tree
                children.append((_child(found, f".{key}", ("attr", key), child, True), depth))
    elif issubclass(cls, torch.optim.Optimizer):
        children.append((_child(found, ".state", ("attr", "state"), value.state, False), max_depth))
    elif depth >= max_depth:
        return
    elif issubclass(cls, dict):
        for index, (key, item) in enumerate(value.items()):
            text = _key_text(key)
            if index >= max_items or text is None:
                break
            children.append((_child(found, f"[{text}]", ("item", key), item, found.in_module), depth + 1))
    elif issubclass(cls, (list, tuple, collections.deque)):
        if list_items:
            for index, item in enumerate(value):
                if index >= max_items:
                    break
                children.append((_child(found, f"[{index}]", ("item", index), item, found.in_module), depth + 1))
    elif not issubclass(cls, (set, frozenset)):
        try:
            attrs = vars(value)
        except Exception:  # noqa: BLE001 - no __dict__, or an object that fails to give it
            return
        for key, attr in list(attrs.items()):
            if not key.startswith("__"):
                children.append((_child(found, f".{key}", ("attr", key), attr, False), depth + 1))
    if depth >= max_depth and not issubclass(cls, torch.nn.Module):
        return
    for child, child_depth in children:
        if child_depth <= max_depth:
            yield from _walk(child, child_depth, max_depth, list_items, max_items, seen)


def _child(parent: Found, suffix: str, step: tuple[str, Any], value: Any, in_module: bool) -> Found:
    return Found(parent.path + suffix, value, parent.steps + (step,), in_module)


def resolve(value: Any, steps: tuple[tuple[str, Any], ...]) -> Any:
    """Follow ``steps`` from ``value`` again; :data:`MISSING` where the path broke.

    Steps are ``("attr", name)``, ``("item", key)``, and, for functions, ``("cell", name)``
    (a closure variable), ``("default", index)`` and ``("kwdefault", name)``.
    """
    for kind, key in steps:
        try:
            if kind == "attr":
                value = getattr(value, key)
            elif kind == "item":
                value = value[key]
            elif kind == "cell":  # a closure variable of a function
                value = value.__closure__[value.__code__.co_freevars.index(key)].cell_contents
            elif kind == "default":
                value = value.__defaults__[key]
            elif kind == "kwdefault":
                value = value.__kwdefaults__[key]
            else:
                return MISSING
        except (AttributeError, KeyError, IndexError, TypeError, ValueError):
            return MISSING
    return value
