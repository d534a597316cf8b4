"""How big a holder is: tensor bytes, items, and the autograd graph it keeps alive.

A tensor with a ``grad_fn`` keeps its whole history alive: every node, and every tensor those
nodes saved for backward until ``backward()`` frees them. :func:`measure` walks that graph
(bounded by ``node_budget``), counts nodes and the saved tensors still present, and says whether
they are present at all (``graph_alive``: the graph was never backpropagated, as in evaluation
without ``torch.no_grad()``). Nodes themselves live in C++ and cannot be sized exactly; they
count :data:`NODE_BYTES` each (an estimate, flagged as such in reports).

Usage::

    from devicekit.memory.leaks.measure import measure

    size = measure(total_loss)
    size.bytes, size.items, size.nodes, size.effective
"""

from __future__ import annotations

import collections
import functools
import gc
import types
from typing import Any, NamedTuple

import torch

from devicekit.memory.leaks.reach import LRU_TYPE
from devicekit.memory.roots import is_user_file
from devicekit.memory.tensors import storage_bytes, storage_key

__all__ = ["NODE_BYTES", "THROUGH", "Size", "measure"]

#: how a measured holder reached its tensors: bits of ``Size.through``
THROUGH = {"closure": 1, "traceback": 2, "lru": 4, "default": 8}

#: estimated bytes one autograd node keeps alive (C++ node, edges, metadata); not measurable
NODE_BYTES = 256
_saved_attrs: dict[type, tuple[str, ...]] = {}
_MAX_DEPTH = 6  # hooks dict -> hook -> closure list -> tensor; errors -> exception -> traceback -> frame


class Size(NamedTuple):
    """``bytes``: tensor storage (saved tensors included); ``items``: container length.

    A tuple of plain numbers, so the garbage collector stops tracking it: the detector keeps
    one per holder per step, and its per-step collection must not grow with them.
    """

    bytes: int = 0
    items: int = 0
    nodes: int = 0
    graph_alive: bool = False
    estimated: bool = False
    tensors: int = 0
    scalars: int = 0  # tensors of one element (a logged loss)
    through: int = 0  # THROUGH flags of the paths that reached tensors

    @property
    def effective(self) -> int:
        """Bytes plus the node estimate: the figure the leak test follows."""
        return self.bytes + self.nodes * NODE_BYTES


class _Tally:
    def __init__(self, node_budget: int) -> None:
        self.storages: set[tuple[str, int]] = set()
        self.nodes: set[int] = set()
        self.keep: list[Any] = []  # node wrappers stay alive during one walk so ids stay unique
        self.bytes = 0
        self.graph_alive = False
        self.budget = node_budget
        self.truncated = False
        self.seen: set[int] | None = None
        self.tensors = 0
        self.scalars = 0
        self.through = 0
        self.containers: set[int] = set()  # each container once: closures and frames can loop

    def tensor(self, tensor: torch.Tensor, with_graph: bool = True) -> None:
        if self.seen is not None:  # saved tensors too: torch keeps their Python objects alive
            self.seen.add(id(tensor))
            base = tensor._base  # a view keeps its base tensor object alive too
            if base is not None:
                self.seen.add(id(base))
        if with_graph:
            self.tensors += 1
            self.scalars += tensor.numel() <= 1
        key = storage_key(tensor)
        if key is None or key not in self.storages:
            if key is not None:
                self.storages.add(key)
            self.bytes += storage_bytes(tensor)
        if with_graph and tensor.grad_fn is not None:
            self.graph(tensor.grad_fn)

    def graph(self, root: Any) -> None:
        stack = [root]
        while stack:
            node = stack.pop()
            if id(node) in self.nodes:
                continue
            if len(self.nodes) >= self.budget:
                self.truncated = True
                return
            self.nodes.add(id(node))
            self.keep.append(node)
            for name in _saved_names(type(node)):
                try:
                    saved = getattr(node, name)
                except RuntimeError:  # freed by backward()
                    continue
                if isinstance(saved, torch.Tensor):
                    self.graph_alive = True
                    self.tensor(saved, with_graph=False)
                elif isinstance(saved, (tuple, list)):
                    for item in saved:
                        if isinstance(item, torch.Tensor):
                            self.graph_alive = True
                            self.tensor(item, with_graph=False)
            for next_node, _ in getattr(node, "next_functions", ()):
                if next_node is not None:
                    stack.append(next_node)


def _saved_names(node_type: type) -> tuple[str, ...]:
    names = _saved_attrs.get(node_type)
    if names is None:
        names = tuple(n for n in dir(node_type) if n.startswith("_saved_"))
        _saved_attrs[node_type] = names
    return names


def measure(value: Any, *, node_budget: int = 4000, max_items: int = 4096,
            seen: set[int] | None = None, inside: set[int] | None = None) -> Size:
    """Size of what ``value`` holds (tensor, container of tensors, object with tensor attributes,
    functions' closures and defaults, ``lru_cache`` results, exceptions' traceback frames).
    ``seen``: ids of the tensor objects met are added to it; ``inside``: ids of the containers."""
    tally = _Tally(node_budget)
    tally.seen = seen
    if inside is not None:
        tally.containers = inside
    items = _items(value)
    scale = _visit(value, tally, 0, max_items)
    nodes = len(tally.nodes)
    if scale != 1.0:
        return Size(int(tally.bytes * scale), items, int(nodes * scale), tally.graph_alive, True,
                    int(tally.tensors * scale), int(tally.scalars * scale), tally.through)
    return Size(tally.bytes, items, nodes, tally.graph_alive, tally.truncated, tally.tensors,
                tally.scalars, tally.through)


def _items(value: Any) -> int:
    if isinstance(value, (list, dict, set, tuple, collections.deque)):
        return len(value)
    if isinstance(value, LRU_TYPE):
        return int(value.cache_info().currsize)
    return 0


def _inner(value: Any, depth: int) -> tuple[Any, int] | None:
    """What ``value`` holds that can hold tensors, and the :data:`THROUGH` flag of that path;
    None when it is a leaf."""
    if isinstance(value, dict):
        return value.values(), 0
    if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        return value, 0
    if isinstance(value, types.FunctionType):  # a hook or a deferred lambda: what it captured
        cells = []
        for cell in value.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:
                continue
        defaults = [*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values()]
        return [*cells, *defaults], (THROUGH["default"] if defaults else 0) | (THROUGH["closure"] if cells else 0)
    if isinstance(value, functools.partial):
        return [*value.args, *value.keywords.values()], THROUGH["closure"]
    if isinstance(value, types.MethodType):  # a bound method as a hook: its object's state
        return [value.__self__], THROUGH["closure"]
    if isinstance(value, LRU_TYPE):
        results = [v for v in gc.get_referents(value) if isinstance(v, (torch.Tensor, tuple, list, dict))]
        return results, THROUGH["lru"]
    if isinstance(value, BaseException):
        return [value.__traceback__, value.__context__, value.__cause__], THROUGH["traceback"]
    if isinstance(value, types.TracebackType):
        return [value.tb_frame, value.tb_next], THROUGH["traceback"]
    if isinstance(value, types.FrameType):
        user = is_user_file(value.f_code.co_filename)
        return (list(value.f_locals.values()) if user else []), THROUGH["traceback"]
    if (hasattr(value, "__dict__") and depth > 0
            and not isinstance(value, (type, torch.nn.Module, torch.optim.Optimizer, types.ModuleType))):
        return [v for v in vars(value).values()
                if isinstance(v, (torch.Tensor, list, dict, tuple, types.FunctionType))], 0
    return None


def _visit(value: Any, tally: _Tally, depth: int, max_items: int, through: int = 0) -> float:
    """Add ``value`` to ``tally``; return the scale factor when only a sample of items was seen."""
    if issubclass(type(value), torch.Tensor):  # not isinstance: a dead weak proxy raises on __class__
        tally.tensor(value)
        tally.through |= through
        return 1.0
    if depth > _MAX_DEPTH or value is None or id(value) in tally.containers:
        return 1.0
    try:
        inner = _inner(value, depth)
    except Exception:  # noqa: BLE001 - a user object that fails to be looked into holds nothing here
        return 1.0
    if inner is None:
        return 1.0
    tally.containers.add(id(value))
    items, flag = inner
    through |= flag
    count = len(items)
    if count > max_items:  # measure the newest items, scale up: a leak grows at the end
        sample = list(items)[-max_items:]
        for item in sample:
            _visit(item, tally, depth + 1, max_items, through)
        return count / max_items
    for item in items:
        _visit(item, tally, depth + 1, max_items, through)
    return 1.0
