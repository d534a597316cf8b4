"""The autograd graph a tensor keeps alive: its nodes, saved tensors and leaves, walked once.

A tensor with a ``grad_fn`` keeps every node behind it, every tensor those nodes saved for
backward until ``backward()`` frees them, and the leaves the graph ends in (a parameter, an
input made with ``requires_grad_()``, and their ``.grad``). :func:`walk_graph` walks them into a
:class:`GraphPart`. A leak's graphs are the same from one step to the next plus one more step's
(``total_loss += loss``, a hook per step keeping each output), so a :class:`GraphCache` keeps
each part walked at one measurement for the next: a part met again is merged, not walked (a
few set unions instead of a getattr per saved tensor per node), which keeps a leaking step's
check from growing with the leak. Leaves are read afresh every time (``.grad`` is replaced by
``zero_grad``), and a part is walked again after :data:`MAX_USES` uses (``backward()`` may free
what it saved since). Parts not met at a measurement are dropped at :meth:`GraphCache.sweep`,
so the cache never keeps a graph alive more than one step after the program let it go.

Usage::

    cache = GraphCache()
    part = walk_graph(loss.grad_fn, cache=cache)     # nodes, saved storages, leaves
    part.nodes, part.storages, part.alive, part.freed
    cache.sweep()                                    # after each measurement
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from devicekit.memory.tensors import storage_bytes, storage_key

__all__ = ["GraphCache", "GraphPart", "MAX_USES", "walk_graph"]

#: measurements a walked part is reused for before it is walked again
MAX_USES = 4
_saved_attrs: dict[type, tuple[str, ...]] = {}
_LEAF_TYPES: set[type] = set()  # node types with a `variable` (AccumulateGrad)
_NOT_TENSORS = ("_sym_sizes", "_sym_strides", "_sizes", "_strides", "_dim", "_dtype", "_options", "_sym_numel",
                "_sym_storage_offset", "_keepdim", "_alpha", "_beta", "_exponent", "_threshold")


class GraphPart(NamedTuple):
    """What one node's graph keeps alive, as walked."""

    #: the node wrappers walked: kept, so their ids name the nodes while the part lives
    keep: tuple[Any, ...]
    nodes: frozenset[int]
    #: storage key -> bytes, of the tensors the nodes saved
    storages: dict[tuple[str, int], int]
    #: ids of the saved tensors' Python objects (and their bases): explained survivors
    tensor_ids: frozenset[int]
    #: AccumulateGrad nodes: their leaf and its ``.grad`` are read afresh at every merge
    leaves: tuple[Any, ...]
    #: activations still saved (more than wrapped numbers): never backpropagated, or retained
    alive: bool
    #: part of it was backpropagated: saved tensors freed
    freed: bool
    truncated: bool
    #: tensors' own attribute values met on saved tensors (walked by the caller)
    attrs: tuple[Any, ...] = ()


class GraphCache:
    """Parts walked at the last measurement, by their root node; see the module docstring."""

    def __init__(self) -> None:
        self._parts: dict[int, tuple[GraphPart, int]] = {}
        self._used: set[int] = set()

    def get(self, node: Any) -> GraphPart | None:
        found = self._parts.get(id(node))
        if found is None or found[0].keep[0] is not node or found[1] >= MAX_USES:
            return None
        self._parts[id(node)] = (found[0], found[1] + 1)
        self._used.add(id(node))
        return found[0]

    def put(self, node: Any, part: GraphPart) -> None:
        self._parts[id(node)] = (part, 0)
        self._used.add(id(node))

    def sweep(self) -> None:
        """Drop the parts not met since the last sweep (their graphs may be gone)."""
        self._parts = {key: value for key, value in self._parts.items() if key in self._used}
        self._used = set()

    def clear(self) -> None:
        self._parts.clear()
        self._used.clear()


def walk_graph(root: Any, *, budget: int = 4000, cache: GraphCache | None = None) -> GraphPart:
    """Walk the graph from ``root`` (a ``grad_fn``), at most ``budget`` nodes not merged from
    ``cache`` (parts walked at the last measurement)."""
    if cache is not None:
        found = cache.get(root)
        if found is not None:
            return found
    keep: list[Any] = []
    nodes: set[int] = set()
    storages: dict[tuple[str, int], int] = {}
    tensor_ids: set[int] = set()
    leaves: list[Any] = []
    attrs: list[Any] = []
    alive = freed = truncated = False
    walked = 0
    stack = [root]
    while stack:
        node = stack.pop()
        key = id(node)
        if key in nodes:
            continue
        part = cache.get(node) if cache is not None else None
        if part is not None:  # walked at the last measurement: merged
            keep.extend(part.keep)
            nodes |= part.nodes
            for storage, size in part.storages.items():
                storages.setdefault(storage, size)
            tensor_ids |= part.tensor_ids
            leaves.extend(part.leaves)
            alive, freed, truncated = alive or part.alive, freed or part.freed, truncated or part.truncated
            continue
        if walked >= budget:
            truncated = True
            break
        walked += 1
        nodes.add(key)
        keep.append(node)
        kind = type(node)
        for name in _saved_names(kind):
            try:
                saved = getattr(node, name)
            except RuntimeError:  # freed by backward(), which frees all of a node's saved tensors at once
                freed = True
                break
            if isinstance(saved, torch.Tensor):
                items: Any = (saved,)
            elif isinstance(saved, (tuple, list)) and saved and isinstance(saved[0], torch.Tensor):
                items = saved
            else:
                if saved is not None and (not isinstance(saved, (tuple, list)) or saved):
                    _not_tensors(kind, name)  # sizes, strides, scalars: the same for every node of the type
                continue
            for tensor in items:
                if tensor.numel() > 1:  # a wrapped number (`0.02 * loss` saves 0.02) is no activation
                    alive = True
                tensor_ids.add(id(tensor))
                base = tensor._base
                if base is not None:
                    tensor_ids.add(id(base))
                skey = storage_key(tensor)
                storages.setdefault(skey if skey is not None else ("tensor", id(tensor)), storage_bytes(tensor))
                own = getattr(tensor, "__dict__", None)
                if own:
                    attrs.extend(own.values())
        if kind in _LEAF_TYPES:
            leaves.append(node)
        for next_node, _ in node.next_functions:
            if next_node is not None:
                stack.append(next_node)
    part = GraphPart(tuple(keep), frozenset(nodes), storages, frozenset(tensor_ids), tuple(leaves), alive, freed,
                     truncated, tuple(attrs))
    if cache is not None and not truncated:
        cache.put(root, part)
    return part


def _saved_names(node_type: type) -> tuple[str, ...]:
    """The saved attributes of a node type that can hold tensors (``_saved_self``; not
    ``_saved_self_sym_sizes``: each is looked at once, then left out for the type)."""
    names = _saved_attrs.get(node_type)
    if names is None:
        if hasattr(node_type, "variable"):
            _LEAF_TYPES.add(node_type)
        names = tuple(n for n in dir(node_type) if n.startswith("_saved_") and not n.endswith(_NOT_TENSORS))
        if hasattr(node_type, "saved_tensors"):  # a custom autograd.Function's ctx
            names += ("saved_tensors",)
        _saved_attrs[node_type] = names
    return names


def _not_tensors(node_type: type, name: str) -> None:
    _saved_attrs[node_type] = tuple(n for n in _saved_attrs[node_type] if n != name)
