"""From surviving memory to named holders: the leak finder's search for what keeps a tensor.

Each step, :class:`~devicekit.memory.leaks.survivors.SurvivorWatch` lists the tensors that
outlived the step after the one that made them. Those already inside a measured holder are
explained; for the rest :func:`~devicekit.memory.leaks.reach.find_paths` finds the shortest
named path from the loop's variables, and every container on that path that can be re-read by
name (``model.1._forward_hooks``, ``MyModel.cache``, ``opt.param_groups``, ``pending_logs``, an
``lru_cache``) becomes a holder, measured from then on like the ones named up front. Which of
them leaks is left to the measurement: only the container that gains something every step grows.
Searches are bounded: a kind of tensor (dtype, shape, autograd state) found nowhere is searched
again at most every few steps, and the report says how much such unnamed memory grows.

Usage::

    found = HolderDiscovery()
    found.scan(step)                                  # after the step's garbage collection
    new = found.search(unexplained, roots, step)      # {path: Holder}, also in found.holders
    found.pattern("model.1._forward_hooks")           # ("[3].<closure feats>[0]", False)
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch

from devicekit.memory.leaks.holders import Holder
from devicekit.memory.leaks.reach import LRU_TYPE, Edge, find_paths, is_user_class
from devicekit.memory.leaks.survivors import SurvivorWatch, signature
from devicekit.memory.paths import CONTAINERS
from devicekit.memory.roots import MISSING, Root, is_user_file
from devicekit.memory.tensors import total_bytes

__all__ = ["HolderDiscovery", "code_roots"]

_RETRY_EVERY = 3  # steps between searches for one kind of tensor


def code_roots(namespace: dict[str, Any]) -> list[Root]:
    """User functions and classes of a namespace: their defaults, closures, class attributes
    and caches can hold tensors, but :func:`~devicekit.memory.roots.frame_roots` skips them."""
    roots = []
    for name, value in list(namespace.items()):
        if name.startswith("__"):
            continue
        cls = type(value)  # not isinstance: it reads __class__, which a dead weak proxy raises on
        if cls is types.FunctionType and is_user_file(value.__code__.co_filename):
            roots.append(Root(name, "global", (lambda v=value: v)))
        elif issubclass(cls, type) and is_user_class(value):
            roots.append(Root(name, "class", (lambda v=value: v)))
    return roots


class HolderDiscovery:
    """See the module docstring."""

    def __init__(self) -> None:
        self.survivors = SurvivorWatch()
        self.holders: dict[str, Holder] = {}
        self._via: dict[str, str] = {}
        self._lru: set[str] = set()
        self._searched: dict[tuple[Any, ...], int] = {}  # signature -> last step searched
        self._failed: set[tuple[Any, ...]] = set()  # signatures a search found no path to
        self.unnamed_bytes: list[tuple[int, int]] = []  # (step, bytes of survivors found nowhere)
        self.searches = 0

    def scan(self, step: int) -> list[torch.Tensor]:
        return self.survivors.scan(step)

    def pattern(self, path: str) -> tuple[str, bool]:
        """``(via, is_lru)`` for a discovered holder: the path from it to the tensor it keeps."""
        return self._via.get(path, ""), path in self._lru

    def search(self, unexplained: list[torch.Tensor], roots: list[Root], step: int,
               held: set[int]) -> dict[str, Holder]:
        """Name the holders of ``unexplained`` survivors; ``held``: ids of values already measured."""
        targets: dict[int, torch.Tensor] = {}
        unnamed: list[torch.Tensor] = []
        for tensor in unexplained:
            sig = signature(tensor)
            last = self._searched.get(sig)
            if last is not None and 0 < step - last < _RETRY_EVERY:
                if sig in self._failed:
                    unnamed.append(tensor)
                continue
            self._searched[sig] = step  # a kind of tensor is searched for once every few steps
            targets[id(tensor)] = tensor
        if not targets:
            self._note_unnamed(unnamed, step)
            return {}
        self.searches += 1
        paths = find_paths(targets, roots)
        new: dict[str, Holder] = {}
        for root, edges in paths.values():
            for path, holder, via in _candidates(root, edges):
                value = holder.get()
                if path in self.holders or id(value) in held:
                    continue
                held.add(id(value))
                new[path] = holder
                # a local name is kept without its frame; the detector reads it from the current one
                self.holders[path] = holder if holder.origin != "local" else dataclasses.replace(
                    holder, root=Root(root.name, "local", _gone))
                self._via[path] = via
                if isinstance(value, LRU_TYPE):
                    self._lru.add(path)
        for key, tensor in targets.items():  # searched now, and no path found
            if key not in paths:
                self._failed.add(signature(tensor))
                unnamed.append(tensor)
            else:
                self._failed.discard(signature(tensor))
        self._note_unnamed(unnamed, step)
        return new

    def _note_unnamed(self, tensors: list[torch.Tensor], step: int) -> None:
        if tensors:
            self.unnamed_bytes.append((step, total_bytes(tensors)))

    def clear(self) -> None:
        """Drop every reference to the program's objects (what was learned about paths stays)."""
        self.holders.clear()
        self.survivors.clear()


def _gone() -> Any:
    return MISSING


def _candidates(root: Root, edges: list[Edge]) -> list[tuple[str, Holder, str]]:
    """Every container on the path that can be re-read by name, with the rest of the path."""
    found = []
    values = [root.get(), *(edge.value for edge in edges)]
    steps: list[tuple[str, Any]] = []
    resolvable = True
    for index, value in enumerate(values[:-1]):  # the last value is the tensor itself
        if index > 0:
            step = edges[index - 1].step
            if step is None:
                resolvable = False
            else:
                steps.append(step)
        if not resolvable:
            break
        if isinstance(value, (*CONTAINERS, LRU_TYPE)):
            path = root.name + "".join(edge.label for edge in edges[:index])
            in_module = index > 0 and isinstance(values[index - 1], torch.nn.Module)
            via = "".join(edge.label for edge in edges[index:])
            found.append((path, Holder(path, root.origin, in_module, root, tuple(steps)), via))
    return found
