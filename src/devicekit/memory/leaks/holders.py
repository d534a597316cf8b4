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

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from devicekit.memory.paths import CONTAINERS, resolve, walk
from devicekit.memory.roots import MISSING, Root, is_plain_value

__all__ = ["Holder", "discover"]

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
            obj = found.value
            cls = type(obj)  # not isinstance: a dead weak proxy raises on __class__
            if not issubclass(cls, _HOLDS) or issubclass(cls, torch.nn.Parameter):
                continue
            holder = Holder(found.path, root.origin, found.in_module, root, found.steps)
            rank = (0 if found.in_module else 1, _ORIGIN_RANK.get(root.origin, 9), len(found.steps))
            current = best.get(id(obj))
            if current is None or rank < current[0]:
                best[id(obj)] = (rank, holder)
    return {holder.path: holder for _, holder in best.values()}
