"""Holder candidates: every named tensor or container a loop can keep across steps.

From the roots of a loop (the locals and globals of the frame that calls ``ld.step()``, or the
globals, closure cells and bound ``self`` of a step function) :func:`discover` walks two named
steps deep (``model.history``, ``stats['losses']``, ``self.cache``) and keeps tensors, growable
containers and exceptions (``self.last_error``: a chain of them can grow behind one name). One object reachable under several names is kept once, under the most
telling name: an attribute of a module first, then the shortest path.

Usage::

    from devicekit.memory.leaks.holders import discover
    from devicekit.memory.roots import frame_roots

    for path, holder in discover(frame_roots(frame)).items():
        print(path, holder.origin, holder.in_module, type(holder.get()).__name__)
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from devicekit.memory.leaks.reach import GENERATORS, is_user_class
from devicekit.memory.paths import CONTAINERS, Found, resolve, walk
from devicekit.memory.roots import MISSING, Root, is_plain_value, is_user_file

__all__ = ["NOT_NAMESPACES", "Holder", "discover", "namespaces"]

#: what can be a holder: tensors, containers, and an exception (its traceback keeps frames)
_HOLDS = (torch.Tensor, *CONTAINERS, BaseException)
_ORIGIN_RANK = {"watch": -1, "local": 0, "closure": 1, "self": 2, "global": 3}  # watch=: named by the user


@dataclass(frozen=True)
class Holder:
    """A named place that can hold memory across steps; :meth:`get` reads its current value."""

    path: str
    origin: str
    in_module: bool
    root: Root
    steps: tuple[tuple[str, Any], ...]

    def get(self) -> Any:
        value = self.root.get()
        if value is MISSING or not self.steps:
            return value
        return resolve(value, self.steps)


def _is_own(value: Any) -> bool:
    """devicekit's own objects (the detector itself, a timeline) are never holders."""
    return type(value).__module__.startswith("devicekit.")


def discover(roots: Iterable[Root], *, max_depth: int = 2) -> dict[str, Holder]:
    """Candidate holders by path: tensors and containers reachable from ``roots``."""
    best: dict[int, tuple[tuple[int, int, int], Holder]] = {}
    for root in roots:
        value = root.get()
        if value is MISSING or is_plain_value(value) or _is_own(value):
            continue
        for found in walk(root.name, value, max_depth=max_depth):
            for candidate in (found, *_closure_cells(found)):
                obj = candidate.value
                cls = type(obj)  # not isinstance: a dead weak proxy raises on __class__
                if not issubclass(cls, _HOLDS) or issubclass(cls, torch.nn.Parameter):
                    continue
                holder = Holder(candidate.path, root.origin, candidate.in_module, root, candidate.steps)
                rank = (0 if candidate.in_module else 1, _ORIGIN_RANK.get(root.origin, 9), len(candidate.steps))
                current = best.get(id(obj))
                if current is None or rank < current[0]:
                    best[id(obj)] = (rank, holder)
    return {holder.path: holder for _, holder in best.values()}


#: objects whose attribute dict is never a holder: what they hold is named otherwise, or fixed
NOT_NAMESPACES = (type, types.FunctionType, types.MethodType, types.ModuleType, types.BuiltinFunctionType,
                  functools.partial, torch.Tensor, torch.optim.Optimizer, BaseException, *CONTAINERS, tuple,
                  frozenset, *GENERATORS, types.FrameType, types.TracebackType)


def namespaces(roots: Iterable[Root], *, max_depth: int = 2) -> dict[str, Holder]:
    """The attribute dicts of the objects reachable from ``roots`` (``model.__dict__``,
    ``state.__dict__``) and the submodule dicts of modules (``model._modules``): an object that
    gains an attribute (or a submodule) under a new name every step is a growing container,
    though no container of the user's holds what it keeps. Measured by the names added since
    they were first seen (see :class:`~devicekit.memory.leaks.detector.LeakDetector`)."""
    best: dict[int, tuple[tuple[int, int, int], Holder]] = {}
    for root in roots:
        value = root.get()
        if value is MISSING or is_plain_value(value) or _is_own(value):
            continue
        for found in walk(root.name, value, max_depth=max_depth):
            obj = found.value
            cls = type(obj)  # not isinstance: a dead weak proxy raises on __class__
            if issubclass(cls, NOT_NAMESPACES) or _is_own(obj):
                continue
            try:
                attrs = vars(obj)
            except Exception:  # noqa: BLE001 - no __dict__, or an object that fails to give it
                continue
            if type(attrs) is not dict:
                continue
            names = ["__dict__", "_modules"] if issubclass(cls, torch.nn.Module) else ["__dict__"]
            for name in names:
                held = attrs if name == "__dict__" else attrs.get("_modules")
                if type(held) is not dict:
                    continue
                holder = Holder(f"{found.path}.{name}", root.origin, found.in_module or issubclass(cls, torch.nn.Module),
                                root, found.steps + (("attr", name),))
                rank = (0 if found.in_module else 1, _ORIGIN_RANK.get(root.origin, 9), len(found.steps))
                current = best.get(id(held))
                if current is None or rank < current[0]:
                    best[id(held)] = (rank, holder)
    return {holder.path: holder for _, holder in best.values()}


def _closure_cells(found: Found) -> list[Found]:
    """The closure cells of user functions kept as attributes of an object of a user class (a
    LightningModule: ``self.track = track``, where ``track`` rebinds ``nonlocal running``): state
    that lives as long as the object, named ``self.track.running``."""
    value = found.value
    cls = type(value)
    if issubclass(cls, type) or not is_user_class(cls):  # torch's own modules keep no such functions
        return []
    try:
        attrs = list(vars(value).items())
    except Exception:  # noqa: BLE001 - no __dict__, or an object that fails to give it
        return []
    cells = []
    for key, fn in attrs:
        if type(fn) is not types.FunctionType or not fn.__closure__ or not is_user_file(fn.__code__.co_filename):
            continue
        in_module = found.in_module or issubclass(cls, torch.nn.Module)
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__, strict=False):
            try:
                inner = cell.cell_contents
            except ValueError:  # not set yet
                continue
            if inner is not value:
                cells.append(Found(f"{found.path}.{key}.{name}", inner, found.steps + (("attr", key), ("cell", name)),
                                   in_module))
    return cells
