"""Attribute dicts that gain a name every step: ``setattr(model, f"act_{step}", h)``.

Such a loop keeps every value though no container of the user's grows: the holder is the
object's attribute dict (``model.__dict__``, a module's ``model._modules``). Each dict's names
when it is first seen are its own; only the names it gains after that can leak, and it is
measured (through a view of just those names, a new submodule by its parameters and buffers)
once it gains one that can keep memory. Used by :class:`~devicekit.memory.leaks.detector.LeakDetector`.

Usage::

    names = NewNames()
    names.spaces = namespaces(roots)          # the attribute dicts within reach (holders.py)
    names.note_first_seen()                   # each dict's names now are its own
    holders.update(names.gaining())           # dicts that gained a name that keeps memory
    view = names.view(path, value)            # None: not an attribute dict; else measure `view`
    names.added(path)                         # the first names it gained: ["act_1", "act_2", ...]
"""

from __future__ import annotations

from typing import Any

import torch

from devicekit.memory.leaks.holders import Holder
from devicekit.memory.paths import CONTAINERS

__all__ = ["NewNames", "is_namespace_path", "keeps_memory"]

_SHOWN = 3   # names shown in a report


def keeps_memory(value: Any) -> bool:
    """A value that can keep memory alive under an attribute: tensors, containers, exceptions,
    modules (their parameters), numpy arrays."""
    cls = type(value)  # not isinstance: a dead weak proxy raises on __class__
    return (issubclass(cls, (torch.Tensor, torch.nn.Module, BaseException, tuple, *CONTAINERS))
            or (cls.__name__ == "ndarray" and cls.__module__ == "numpy"))


def is_namespace_path(path: str) -> bool:
    """Whether a holder's path names an attribute dict (found from the memory)."""
    return path.endswith((".__dict__", "._modules"))


class NewNames:
    """The attribute dicts in reach, the names each had when first seen, and what they gained."""

    def __init__(self) -> None:
        self.spaces: dict[str, Holder] = {}          # as last discovered
        self._base: dict[str, frozenset[Any]] = {}   # the names each had when first seen
        self._gaining: dict[str, Holder] = {}        # those that gained a name that keeps memory
        self._added: dict[str, list[str]] = {}       # the first names each gained
        self._views: dict[str, dict[str, Any]] = {}  # filled to measure, emptied right after

    def clear(self) -> None:
        """Forget the holders (at stop); what was added stays for the report."""
        self.spaces.clear()
        self._gaining.clear()
        self._views.clear()

    def note_first_seen(self, found: dict[str, Holder] | None = None) -> None:
        """The names each dict (of ``spaces``, or of ``found`` that are attribute dicts) has now
        are its own: only those it gains later can leak."""
        items = self.spaces.items() if found is None else (
            (path, holder) for path, holder in found.items() if is_namespace_path(path))
        for path, holder in items:
            if path not in self._base:
                names = holder.get()
                if type(names) is dict:
                    self._base[path] = frozenset(names)
                elif found is not None:
                    self._base[path] = frozenset()
                del names

    def gaining(self) -> dict[str, Holder]:
        """The dicts that have gained a name that keeps memory since first seen (once gaining,
        always measured)."""
        for path, holder in self.spaces.items():
            if path not in self._gaining and self._gained(path, holder):
                self._gaining[path] = holder
        return {path: self.spaces.get(path, holder) for path, holder in self._gaining.items()}

    def _gained(self, path: str, holder: Holder) -> bool:
        base = self._base.get(path)
        names = holder.get()
        if base is None or type(names) is not dict or len(names) == 0:
            return False
        return any(key not in base and keeps_memory(value) for key, value in list(names.items()))

    def view(self, path: str, attrs: Any) -> dict[str, Any] | None:
        """The values under the names ``attrs`` gained (a submodule by its parameters and
        buffers), in a dict that stays the same object so it is measured as a dict that grows;
        None when ``path`` is not a tracked attribute dict. Empty it after measuring."""
        if path not in self._base or type(attrs) is not dict:
            return None
        view = self._views.setdefault(path, {})
        view.clear()
        base = self._base[path]
        names = self._added.setdefault(path, [])
        for key, value in list(attrs.items()):
            if key in base or not isinstance(key, str) or key.startswith("__"):
                continue
            if isinstance(value, torch.nn.Module):
                parts = [*value.named_parameters(), *value.named_buffers()]
                view.update((f"{key}.{name}", tensor) for name, tensor in parts)
                if not parts:
                    continue
            elif keeps_memory(value):
                view[key] = value
            else:
                continue
            if len(names) < _SHOWN and key not in names:
                names.append(key)
        return view

    def added(self, path: str) -> list[str]:
        """The first names ``path`` gained (for the report)."""
        return self._added.get(path, [])
