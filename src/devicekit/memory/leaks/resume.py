"""Measuring what grows at its end without walking the rest again: lists of tensors and chains.

A leak grows the same way step after step: ``losses.append(loss)`` adds an item at the end of a
list, ``e.__cause__ = self.last_error; self.last_error = e`` and ``out.prev = last_out; last_out
= out`` put a new head before a chain, a hook registered every step adds an entry to a module's
hook dict (and every earlier hook's list gains the step's output). Walking all of it at every
step would make a leaking step's check grow with the leak. :func:`measure_appended` keeps the
:class:`~devicekit.memory.leaks.measure.Tally` of a list, deque or dict of tensors (or of tuples
of them, exceptions, numpy arrays, numbers, and hooks whose closures keep lists of them) and walks
only the items added since and what each earlier hook's lists gained; :func:`measure_chain`
keeps the tally of an exception or tensor chain and walks only the links put before the head it
measured last (the walk stops at what it counted then). Each is valid only while what it counted
is still there: the same container with the same items (checked by weak reference: an id can be
reused; a hook's lists no shorter), or an old head that is still alive and a few links behind
the new one. Otherwise the holder is measured whole. :func:`content_print` and
:func:`tensors_print` tell when a container holds the same things as at its last measurement
(then it keeps its size).

Usage::

    size, state = measure_appended(losses, None)     # state: for the next step (None: not a list of tensors)
    size, state = measure_appended(losses, state)    # walks only the new items
    size, chain = measure_chain(self.last_error, None)
"""

from __future__ import annotations

import collections
import itertools
import types
import weakref
from typing import Any

import torch

from devicekit.memory.leaks.graphs import GraphCache
from devicekit.memory.leaks.measure import MAX_ITEMS, NODE_BYTES, Size, Tally, size_of, walk_into
from devicekit.memory.roots import is_user_file

__all__ = ["Chain", "Resumable", "content_print", "measure_appended", "measure_chain", "tensors_print"]

_LINKS = 16  # links from a new head back to the last one, at most
_NUMBERS = (int, float, bool, str, type(None))
_SCALARS = (int, float, bool, type(None))


class Resumable:
    """A list of tensors (or a dict of them, or of hooks) as last measured; see the module docstring."""

    def __init__(self, value: list[Any] | collections.deque[Any] | dict[Any, Any], node_budget: int) -> None:
        self.container = id(value)
        self.ids: list[int] = []
        self.refs: list[Any] = []  # references to the items' tensors (weak where it can): an id can be reused
        self.prints: list[tuple[tuple[int, int], ...]] = []  # a function's captured containers: (id, length)
        self.tally = _kept_tally(node_budget)
        self.tally.containers = {id(value)}
        #: old functions whose captured lists got longer since (walked again, for what they gained)
        self.grown: list[Any] = []

    def fits(self, value: Any) -> bool:
        count = len(self.ids)
        if id(value) != self.container or len(value) < count:
            return False
        old = list(itertools.islice(_items(value), count))
        if [id(item) for item in old] != self.ids:
            return False
        self.grown = []
        for item, refs, last in zip(old, self.refs, self.prints, strict=True):
            if type(item) is types.FunctionType:
                now = _captured(item)
                if now is None or len(now) != len(last) or any(
                        a[0] != b[0] or a[1] < b[1] for a, b in zip(now, last, strict=True)):
                    return False  # it captures other things now, or fewer: measure afresh
                if now != last:
                    self.grown.append(item)
                continue
            tensors = _tensors_of(item)
            if len(tensors) != len(refs) or any(ref() is not tensor for ref, tensor in zip(refs, tensors, strict=True)):
                return False
        return True

    def add(self, item: Any) -> None:
        self.ids.append(id(item))
        if type(item) is types.FunctionType:
            self.refs.append([])
            self.prints.append(_captured(item) or ())
        else:
            self.refs.append([_ref(thing) for thing in _tensors_of(item)])
            self.prints.append(())

    def rewalk(self, index: int, item: Any) -> None:
        """Walk what a grown function's lists gained since they were last walked."""
        last = self.prints[index]
        self.prints[index] = _captured(item) or ()
        for value, (_, length) in zip(_kept(item), last, strict=False):
            if type(value) in (list, collections.deque) and len(value) > length:
                met = self.tally.met
                for added in itertools.islice(value, length, None):
                    if (id(added), True) not in met:  # every hook keeps the same output: counted once
                        walk_into(added, self.tally, MAX_ITEMS)


def _items(value: Any) -> Any:
    return value.values() if isinstance(value, dict) else value


def _kept(fn: types.FunctionType) -> list[Any]:
    """What a function keeps: its closure cells' values and its default arguments (numbers left out)."""
    values = []
    for cell in fn.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:
            continue
    values += [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
    return [value for value in values if type(value) not in _NUMBERS]


def _captured(fn: types.FunctionType) -> tuple[tuple[int, int], ...] | None:
    """What a hook or a deferred function keeps (closure cells, default arguments), as
    ``(id, length)``; None when it keeps something else than tensors and lists of them."""
    found = []
    for value in _kept(fn):
        cls = type(value)
        if cls in (list, collections.deque):
            found.append((id(value), len(value)))
        elif _fixed(value):
            found.append((id(value), 0))
        else:
            return None
    return tuple(found)


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
    if type(item) in _NUMBERS:
        return ()
    return (item,) if _fixed(item) else tuple(item)


def _tensors_only(item: Any) -> bool:
    if _fixed(item) or type(item) in _NUMBERS:  # a log of `loss.item()` values holds no tensor
        return True
    if type(item) is types.FunctionType:  # a hook: what it captured, tensors and lists of them
        return _captured(item) is not None and is_user_file(item.__code__.co_filename)
    return type(item) in (tuple, list) and all(_fixed(x) for x in item)


def measure_appended(value: list[Any] | collections.deque[Any] | dict[Any, Any], state: Resumable | None, *,
                     node_budget: int = 4000, cache: GraphCache | None = None) -> tuple[Size, Resumable | None]:
    """:func:`~devicekit.memory.leaks.measure.measure` for a list, deque or dict of tensors (or
    tuples of them, exceptions, numpy arrays, hooks that capture lists of them), walking only
    the items added since ``state`` and the hooks whose lists got longer; returns the size and
    the state for next time (None when it holds anything else: then measure it whole)."""
    if state is None or not state.fits(value):
        state = Resumable(value, node_budget)
    new = list(itertools.islice(_items(value), len(state.ids), None))
    if not all(_tensors_only(item) for item in new):
        return Size(), None
    count = len(state.ids)
    try:
        for item in new:
            state.add(item)
    except TypeError:  # a tensor subclass or an array without weak references
        return Size(), None
    state.tally.cache = cache
    index = {id(item): i for i, item in enumerate(itertools.islice(_items(value), count))} if state.grown else {}
    for item in state.grown:
        state.rewalk(index[id(item)], item)
    state.grown = []
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


def content_print(value: Any) -> tuple[int, int, int]:
    """Identity, length and the identities of the items: a container whose print did not change
    holds the same objects (what grows inside one of them is found from the memory)."""
    items = value.values() if isinstance(value, dict) else value
    return (id(value), len(value), hash(tuple(map(id, items))))


def tensors_print(value: Any) -> tuple[int, ...] | None:
    """The identities of what a small container holds, two levels deep, when that is only tensors
    without autograd graph (and containers of them); None otherwise: then it is measured afresh
    (a tensor with a graph, a function, an object can grow without its identity changing)."""
    found = [id(value), len(value)]
    items = value.values() if isinstance(value, dict) else value
    for item in items:
        cls = type(item)
        if issubclass(cls, torch.Tensor):
            if item.requires_grad or item.__dict__:
                return None
            found.append(id(item))
        elif cls in (dict, list, collections.deque) or issubclass(cls, dict):
            found += (id(item), len(item))
            for inner in (item.values() if isinstance(item, dict) else item):
                if type(inner) in _SCALARS:  # SGD's `momentum_buffer: None`, a float `step`
                    continue
                if not issubclass(type(inner), torch.Tensor) or inner.requires_grad or inner.__dict__:
                    return None
                found.append(id(inner))
        else:
            return None
    return tuple(found)
