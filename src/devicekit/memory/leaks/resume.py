"""Measuring what grows at its end without walking the rest again: lists of tensors and chains.

A leak grows the same way step after step: ``losses.append(loss)`` adds an item at the end of a
list, ``e.__cause__ = self.last_error; self.last_error = e`` and ``out.prev = last_out; last_out
= out`` put a new head before a chain. Walking all of it at every step would make a leaking
step's check grow with the leak. :func:`measure_appended` keeps the
:class:`~devicekit.memory.leaks.measure.Tally` of a list of tensors (or of tuples of them,
exceptions, numpy arrays) and walks only the items appended since; :func:`measure_chain` keeps the tally of an exception or
tensor chain and walks only the links put before the head it measured last (the walk stops at
what it counted then). Each is valid only while what it counted is still there: the same list
with the same items (checked by weak reference: an id can be reused), or an old head that is
still alive and a few links behind the new one. Otherwise the holder is measured whole.

Usage::

    size, state = measure_appended(losses, None)     # state: for the next step (None: not a list of tensors)
    size, state = measure_appended(losses, state)    # walks only the new items
    size, chain = measure_chain(self.last_error, None)
"""

from __future__ import annotations

import collections
import itertools
import weakref
from typing import Any

import torch

from devicekit.memory.leaks.graphs import GraphCache
from devicekit.memory.leaks.measure import MAX_ITEMS, NODE_BYTES, Size, Tally, size_of, walk_into

__all__ = ["Chain", "Resumable", "measure_appended", "measure_chain"]

_LINKS = 16  # links from a new head back to the last one, at most


class Resumable:
    """A list of tensors as last measured; see the module docstring."""

    def __init__(self, value: list[Any] | collections.deque[Any], node_budget: int) -> None:
        self.container = id(value)
        self.ids: list[int] = []
        self.refs: list[Any] = []  # references to the items' tensors (weak where it can): an id can be reused
        self.tally = _kept_tally(node_budget)
        self.tally.containers = {id(value)}

    def fits(self, value: Any) -> bool:
        count = len(self.ids)
        if id(value) != self.container or len(value) < count:
            return False
        old = list(itertools.islice(value, count))
        return [id(item) for item in old] == self.ids and all(
            ref() is tensor for item, refs in zip(old, self.refs, strict=True)
            for ref, tensor in zip(refs, _tensors_of(item), strict=True))

    def add(self, item: Any) -> None:
        self.ids.append(id(item))
        self.refs.append([_ref(thing) for thing in _tensors_of(item)])


def _ref(thing: Any) -> Any:
    """A weak reference; an exception has none, so it is held (until the list changes)."""
    return (lambda: thing) if isinstance(thing, BaseException) else weakref.ref(thing)


def _kept_tally(node_budget: int) -> Tally:
    """A tally kept from one step to the next (its `keep` holds the graphs' node wrappers, so
    their ids stay unique)."""
    tally = Tally(node_budget)
    tally.seen = set()
    tally.grads = False
    return tally


def _fixed(item: Any) -> bool:
    """What does not change once made, as far as the memory it keeps goes: a tensor, an
    exception (its traceback's frames are finished), a numpy array (its base is fixed)."""
    cls = type(item)
    return issubclass(cls, (torch.Tensor, BaseException)) or (cls.__name__ == "ndarray" and cls.__module__ == "numpy")


def _tensors_of(item: Any) -> tuple[Any, ...]:
    return (item,) if _fixed(item) else tuple(item)


def _tensors_only(item: Any) -> bool:
    if _fixed(item):
        return True
    return type(item) in (tuple, list) and all(_fixed(x) for x in item)


def measure_appended(value: list[Any] | collections.deque[Any], state: Resumable | None, *,
                     node_budget: int = 4000, cache: GraphCache | None = None) -> tuple[Size, Resumable | None]:
    """:func:`~devicekit.memory.leaks.measure.measure` for a list or deque of tensors (or tuples
    of them, exceptions, numpy arrays), walking only the items appended since ``state``; returns the size and the state
    for next time (None when the list holds anything else: then measure it whole)."""
    if state is None or not state.fits(value):
        state = Resumable(value, node_budget)
    new = list(itertools.islice(value, len(state.ids), None))
    if not all(_tensors_only(item) for item in new):
        return Size(), None
    try:
        for item in new:
            state.add(item)
    except TypeError:  # a tensor subclass or an array without weak references
        return Size(), None
    state.tally.cache = cache
    for item in new:
        walk_into(item, state.tally, MAX_ITEMS)
    return size_of(state.tally, len(value)), state


class Chain:
    """An exception or tensor chain as last measured: its head and the tally. A tensor head is
    held weakly; an exception cannot be, so it is held until the next measurement (the detector
    drops the chain as soon as the holder holds anything else)."""

    def __init__(self, head: Any, node_budget: int) -> None:
        self.tally = _kept_tally(node_budget)
        self.hold(head)

    def hold(self, head: Any) -> None:
        self.head: Any = (lambda: head) if isinstance(head, BaseException) else weakref.ref(head)


def _links(value: Any) -> list[Any]:
    if isinstance(value, BaseException):
        return [link for link in (value.__cause__, value.__context__) if link is not None]
    attrs = getattr(value, "__dict__", None) if issubclass(type(value), torch.Tensor) else None
    return [v for v in attrs.values() if issubclass(type(v), torch.Tensor)] if attrs else []


def _behind(value: Any, old: Any) -> bool:
    """``old`` is one to :data:`_LINKS` links behind ``value``."""
    frontier = _links(value)
    for _ in range(_LINKS):
        if any(link is old for link in frontier):
            return True
        frontier = [nxt for link in frontier for nxt in _links(link)][:_LINKS]
        if not frontier:
            return False
    return False


def measure_chain(value: Any, state: Chain | None, *, node_budget: int = 4000,
                  cache: GraphCache | None = None) -> tuple[Size, Chain | None]:
    """The size of an exception or a tensor and what it links to, walking only what was put
    before the head of ``state``; the state for next time (None: ``value`` is no chain head)."""
    if not isinstance(value, BaseException) and not issubclass(type(value), torch.Tensor):
        return Size(), None
    try:
        old = state.head() if state is not None else None
        fresh = old is None or old is value or not _behind(value, old)
        if fresh:
            state = Chain(value, node_budget)
        else:
            state.hold(value)  # type: ignore[union-attr]
    except TypeError:  # no weak references to it
        return Size(), None
    assert state is not None
    tally = state.tally
    tally.cache = cache
    before = tally.bytes + len(tally.nodes) * NODE_BYTES
    walk_into(value, tally, MAX_ITEMS)
    if not fresh and not isinstance(value, BaseException):  # a tensor linked before the last head
        tally.attr_bytes += tally.bytes + len(tally.nodes) * NODE_BYTES - before
    return size_of(tally, 0), state
