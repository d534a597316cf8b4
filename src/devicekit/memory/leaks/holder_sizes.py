"""What each named holder keeps, measured step after step for less than walking it whole each time.

:class:`HolderSizes` is the leak detector's tape measure: it remembers, per holder path, what it
needs to measure the next step cheaply. A list (deque, dict) of tensors is measured by what was
appended since the last step (its old items were walked then); an exception or tensor chain by
the links put before its last head (:mod:`~devicekit.memory.leaks.resume`); a container that
holds the same objects as at its last measurement keeps its last size (walking a 10,000-item
dataset list every step would cost more than the step; growth inside one of its items is found
from the memory, and :meth:`HolderSizes.forget` then has it measured afresh). Autograd graphs
walked at the last step are merged rather than walked again (:mod:`~devicekit.memory.leaks.graphs`).

Usage::

    sizes = HolderSizes()
    seen: set[int] = set()
    size = sizes.measure("history", history, seen)   # Size; seen: ids of what it keeps
    sizes.inside["history"]                          # (id of the value, ids of containers inside)
    sizes.graphs.sweep()                             # once per step, after every holder
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from devicekit.memory.leaks.graphs import GraphCache
from devicekit.memory.leaks.measure import Size, measure
from devicekit.memory.leaks.resume import (
    Chain,
    Resumable,
    content_print,
    measure_appended,
    measure_chain,
    tensors_print,
)
from devicekit.memory.paths import CONTAINERS

__all__ = ["HolderSizes"]

_REMEASURE_BELOW = 16  # containers this long keep their size while they hold the same objects
#: measured by what was added since the last step (resume.measure_appended); a hook dict is a dict
_APPENDED = (list, collections.deque, dict, collections.OrderedDict)


class HolderSizes:
    """Measures holders by path, remembering what makes the next measurement cheap."""

    def __init__(self) -> None:
        self.graphs = GraphCache()  # autograd graphs walked at the last step
        # path -> (id of its value, ids of the containers inside it), as last measured
        self.inside: dict[str, tuple[int, set[int]]] = {}
        self._big: dict[str, tuple[Any, Size, frozenset[int]]] = {}
        self._resume: dict[str, Resumable] = {}  # lists of tensors, measured as they grow
        self._chains: dict[str, Chain] = {}  # exceptions and tensors, measured as chains grow
        self._whole: set[str] = set()  # lists that held something else once

    def cached(self, path: str) -> bool:
        """Did ``path``'s last size come from the same-contents cache?"""
        return path in self._big

    def forget(self, path: str) -> None:
        """Measure ``path`` afresh next time (something inside it grew)."""
        self._big.pop(path, None)

    def clear(self) -> None:
        """Let go of every object kept between steps (sizes in :attr:`inside` stay)."""
        self._big.clear()
        self.graphs.clear()
        self._resume.clear()
        self._chains.clear()

    def measure(self, path: str, value: Any, seen: set[int]) -> Size:
        """The size of what ``value`` (the holder at ``path``) keeps; ``seen`` gains its ids."""
        if (isinstance(value, BaseException) or issubclass(type(value), torch.Tensor)) and path not in self._whole:
            size, chain = measure_chain(value, self._chains.get(path), cache=self.graphs)
            if chain is not None:
                self._chains[path] = chain
                seen.update(chain.tally.seen or ())
                self.inside[path] = (id(value), set())
                return size
        self._chains.pop(path, None)  # it holds something else now: let the old chain go
        if type(value) in _APPENDED and path not in self._whole:
            size, state = measure_appended(value, self._resume.get(path), cache=self.graphs)
            if state is not None:
                self._resume[path] = state
                seen.update(state.tally.seen or ())
                self.inside[path] = (id(value), state.tally.containers - {id(value)})
                return size
            self._resume.pop(path, None)
            self._whole.add(path)  # it holds something else: measured whole from now on
        if not isinstance(value, CONTAINERS):
            inside: set[int] = set()
            size = measure(value, seen=seen, inside=inside, cache=self.graphs)
            inside.discard(id(value))
            self.inside[path] = (id(value), inside)
            return size
        # a small container is measured afresh unless it holds only tensors without a graph, two
        # levels deep, the same ones as last time (an optimizer's state, a dict of EMA weights)
        print_ = content_print(value) if len(value) >= _REMEASURE_BELOW else tensors_print(value)
        last = self._big.get(path)
        if print_ is None:
            self._big.pop(path, None)
        elif last is not None and last[0] == print_:
            seen.update(last[2])
            return last[1]
        ids: set[int] = set()
        inside = set()
        size = measure(value, seen=ids, inside=inside, cache=self.graphs)
        inside.discard(id(value))
        self.inside[path] = (id(value), inside)
        seen.update(ids)
        if print_ is not None:
            self._big[path] = (print_, size, frozenset(ids))
        return size
