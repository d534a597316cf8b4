"""How big a holder is: the storage it keeps alive, items, and the autograd graph behind it.

A tensor with a ``grad_fn`` keeps its whole history alive: every node, every tensor those nodes
saved for backward until ``backward()`` frees them, and the leaves the graph ends in (an input
made with ``requires_grad_()`` and its ``.grad``). :func:`measure` walks that graph (bounded by
``node_budget``), counts nodes and every storage still present once, and says whether
activations are still saved (``graph_alive``: never backpropagated, or ``retain_graph=True``)
and whether part of the graph was backpropagated (``graph_freed``). Nodes themselves live in C++
and cannot be sized exactly; they count :data:`NODE_BYTES` each (flagged as an estimate).

Besides containers it follows what keeps tensors alive in training scripts: closures and
default arguments, ``lru_cache`` results, exceptions (their traceback frames and the chain of
``__cause__``/``__context__``), suspended generators' and coroutines' frames, tensors' own
attributes (``out.prev = last_out``), and numpy arrays made by ``.numpy()`` (which keep the
tensor, and so its storage, alive). Chains (a linked list, an exception chain) are walked to
their end, however long, without recursion.

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

from devicekit.memory.leaks.graphs import GraphCache, walk_graph
from devicekit.memory.leaks.reach import GENERATORS, LRU_TYPE, kept_frames, numpy_base
from devicekit.memory.roots import is_user_file
from devicekit.memory.tensors import storage_bytes, storage_key

__all__ = ["MAX_ITEMS", "NODE_BYTES", "THROUGH", "Size", "Tally", "measure", "size_of", "walk_into"]

#: how a measured holder reached its tensors: bits of ``Size.through``
THROUGH = {"closure": 1, "traceback": 2, "lru": 4, "default": 8, "tensor_attr": 16, "generator": 32,
           "numpy": 64, "exception_chain": 128}

#: estimated bytes one autograd node keeps alive (C++ node, edges, metadata); not measurable
NODE_BYTES = 256
MAX_ITEMS = 4096
_PLAIN = frozenset((int, float, complex, str, bytes, bool))
_MAX_DEPTH = 6  # hooks dict -> hook -> closure list -> tensor; errors -> exception -> traceback -> frame


class Size(NamedTuple):
    """``bytes``: storage kept alive (saved tensors and graph leaves included); ``items``:
    container length; ``scalar_bytes``: storage behind one-element tensors (a 0-d loss can keep
    the whole elementwise buffer it was reduced from).

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
    graph_freed: bool = False  # part of the graph was backpropagated (its saved tensors freed)
    scalar_bytes: int = 0
    attr_bytes: int = 0  # effective bytes first reached through tensors' own attributes

    @property
    def effective(self) -> int:
        """Bytes plus the node estimate: the figure the leak test follows."""
        return self.bytes + self.nodes * NODE_BYTES


class Tally:
    """What one measurement has counted so far (also kept between steps by :mod:`~devicekit.memory.leaks.resume`)."""

    def __init__(self, node_budget: int) -> None:
        self.storages: set[tuple[str, int]] = set()
        self.nodes: set[int] = set()
        self.keep: list[Any] = []  # node wrappers stay alive during one walk so ids stay unique
        self.bytes = 0
        self.graph_alive = False
        self.graph_freed = False
        self.budget = node_budget
        self.truncated = False
        self.seen: set[int] | None = None
        self.tensors = 0
        self.scalars = 0
        self.scalar_bytes = 0
        self.through = 0
        self.containers: set[int] = set()  # each container once: closures and frames can loop
        self.attrs: list[Any] = []  # tensors' own attribute values, still to visit
        self.met: set[tuple[int, bool]] = set()  # tensors counted (ids stay: they are held meanwhile)
        self.cache: GraphCache | None = None
        #: count the leaves' ``.grad`` (not in a tally kept across steps: zero_grad replaces them,
        #: and a freed storage's address can come back for another tensor)
        self.grads = True
        self.nodes_read: set[int] = set()  # leaves whose tensor and .grad were counted
        self.attr_bytes = 0

    def tensor(self, tensor: torch.Tensor, with_graph: bool = True) -> None:
        key = (id(tensor), with_graph)
        if key in self.met:  # one tensor in many places (every hook's list holds the output)
            return
        self.met.add(key)
        if self.seen is not None:  # saved tensors too: torch keeps their Python objects alive
            self.seen.add(id(tensor))
            base = tensor._base  # a view keeps its base tensor object alive too
            if base is not None:
                self.seen.add(id(base))
        scalar = with_graph and tensor.numel() <= 1
        if with_graph:
            self.tensors += 1
            self.scalars += scalar
        key = storage_key(tensor)
        if key is None or key not in self.storages:
            if key is not None:
                self.storages.add(key)
            size = storage_bytes(tensor)
            self.bytes += size
            if scalar:
                self.scalar_bytes += size
        attrs = getattr(tensor, "__dict__", None)  # `out.prev = last_out`: a tensor's own attributes
        if attrs:
            self.attrs.extend(attrs.values())
        if with_graph and tensor.grad_fn is not None:
            self.graph(tensor.grad_fn)

    def graph(self, root: Any) -> None:
        if id(root) in self.nodes:  # counted already, with everything behind it
            return
        part = walk_graph(root, budget=self.budget, cache=self.cache)
        self.keep.append(part)  # its node wrappers stay alive during this walk: ids stay unique
        self.nodes |= part.nodes
        for key, size in part.storages.items():
            if key not in self.storages:
                self.storages.add(key)
                self.bytes += size
        if self.seen is not None:  # saved tensors too: torch keeps their Python objects alive
            self.seen |= part.tensor_ids
        self.graph_alive = self.graph_alive or part.alive
        self.graph_freed = self.graph_freed or part.freed
        self.truncated = self.truncated or part.truncated
        self.attrs.extend(part.attrs)
        for leaf in part.leaves:  # read afresh: `.grad` is replaced by zero_grad()
            if id(leaf) in self.nodes_read:
                continue
            self.nodes_read.add(id(leaf))
            variable = leaf.variable
            if isinstance(variable, torch.Tensor):
                self.tensor(variable, with_graph=False)
                if variable.grad is not None and self.grads:
                    self.tensor(variable.grad, with_graph=False)


def size_of(tally: Tally, items: int, scale: float = 1.0) -> Size:
    """The :class:`Size` of what ``tally`` counted (``scale``: when only a sample was walked)."""
    return Size(int(tally.bytes * scale), items, int(len(tally.nodes) * scale), tally.graph_alive,
                tally.truncated or scale != 1.0, int(tally.tensors * scale), int(tally.scalars * scale),
                tally.through, tally.graph_freed, int(tally.scalar_bytes * scale), int(tally.attr_bytes * scale))


def measure(value: Any, *, node_budget: int = 4000, max_items: int = MAX_ITEMS,
            seen: set[int] | None = None, inside: set[int] | None = None, cache: GraphCache | None = None) -> Size:
    """Size of what ``value`` holds (see the module docstring). ``seen``: ids of the tensor
    objects met are added to it; ``inside``: ids of the containers; ``cache``: autograd graphs
    walked at the last measurement (:mod:`~devicekit.memory.leaks.graphs`)."""
    tally = Tally(node_budget)
    tally.seen = seen
    tally.cache = cache
    if inside is not None:
        tally.containers = inside
    items = _items(value)
    scale = walk_into(value, tally, max_items)
    return size_of(tally, items, scale)


def _items(value: Any) -> int:
    if isinstance(value, (list, dict, set, tuple, collections.deque)):
        return len(value)
    if isinstance(value, LRU_TYPE):
        return int(value.cache_info().currsize)
    return 0


def _is_own(value: Any) -> bool:
    return type(value).__module__.startswith("devicekit.")


def _frame_values(frame: types.FrameType | None) -> list[Any]:
    if frame is None or not is_user_file(frame.f_code.co_filename):
        return []
    return list(frame.f_locals.values())


def _inner(value: Any, depth: int) -> tuple[Any, int, list[Any]] | None:
    """What ``value`` holds that can hold tensors, the :data:`THROUGH` flag of that path, and
    the next links of a chain it is part of (walked without counting depth, however long: an
    exception's cause, a traceback's next entry); None when it is a leaf."""
    if isinstance(value, dict):
        return value.values(), 0, []
    if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        return value, 0, []
    if isinstance(value, types.FunctionType):  # a hook or a deferred lambda: what it captured
        cells = []
        for cell in value.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:
                continue
        defaults = [*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values()]
        flag = (THROUGH["default"] if defaults else 0) | (THROUGH["closure"] if cells else 0)
        return [*cells, *defaults], flag, []
    if isinstance(value, functools.partial):
        return [*value.args, *value.keywords.values()], THROUGH["closure"], []
    if isinstance(value, types.MethodType):  # a bound method as a hook: its object's state
        return [value.__self__], THROUGH["closure"], []
    if isinstance(value, LRU_TYPE):
        results = [v for v in gc.get_referents(value) if isinstance(v, (torch.Tensor, tuple, list, dict))]
        return results, THROUGH["lru"], []
    if isinstance(value, BaseException):
        chained = [e for e in (value.__cause__, value.__context__) if e is not None]
        flag = THROUGH["traceback"] | (THROUGH["exception_chain"] if chained else 0)
        return [], flag, [value.__traceback__, *chained]
    if isinstance(value, types.TracebackType):  # its frame, and the callers that frame keeps
        kept = kept_frames(value.tb_frame)
        held = [v for frame in kept[1:] for v in frame.f_locals.values() if not _is_own(v)]
        return [*_frame_values(value.tb_frame), *held], THROUGH["traceback"], [value.tb_next]
    if isinstance(value, types.FrameType):
        return _frame_values(value), THROUGH["traceback"], []
    if isinstance(value, GENERATORS):  # suspended: its frame keeps every local alive
        frame = getattr(value, "gi_frame", None) or getattr(value, "cr_frame", None) or getattr(value, "ag_frame", None)
        return _frame_values(frame), THROUGH["generator"], []
    base = numpy_base(value)
    if base is not None:
        return [base], THROUGH["numpy"], []
    if (hasattr(value, "__dict__") and depth > 0 and not _is_own(value)  # never devicekit's own state
            and not isinstance(value, (type, torch.nn.Module, torch.optim.Optimizer, types.ModuleType))):
        return [v for v in vars(value).values()
                if isinstance(v, (torch.Tensor, list, dict, tuple, types.FunctionType, BaseException,
                                  *GENERATORS))], 0, []
    return None


def walk_into(value: Any, tally: Tally, max_items: int) -> float:
    """Add everything ``value`` holds to ``tally``; return the scale factor when only a sample
    of its items was seen (a leak grows at the end: the newest items are the sample)."""
    scale = 1.0
    stack: list[tuple[Any, int, int]] = [(value, 0, 0)]
    while stack:
        item, depth, through = stack.pop()
        if issubclass(type(item), torch.Tensor):  # not isinstance: a dead weak proxy raises on __class__
            if through & THROUGH["tensor_attr"]:
                before = tally.bytes + len(tally.nodes) * NODE_BYTES
                tally.tensor(item)
                tally.attr_bytes += tally.bytes + len(tally.nodes) * NODE_BYTES - before
            else:
                tally.tensor(item)
            tally.through |= through
            if tally.attrs:  # a tensor's attributes: part of a chain, depth not counted
                stack.extend((v, depth, through | THROUGH["tensor_attr"]) for v in tally.attrs)
                tally.attrs.clear()
            continue
        if depth > _MAX_DEPTH or item is None or id(item) in tally.containers:
            continue
        if type(item) in _PLAIN:
            continue
        try:
            inner = _inner(item, depth)
            if inner is None:
                if _numpy_owner_bytes(item, tally):
                    tally.through |= through | THROUGH["numpy"]
                continue
        except Exception:  # noqa: BLE001 - a user object that fails to be looked into holds nothing here
            continue
        tally.containers.add(id(item))
        items, flag, chain = inner
        through |= flag
        stack.extend((link, depth, through) for link in chain if link is not None)
        if item is value and len(items) > max_items:  # type: ignore[arg-type]
            sample = list(items)[-max_items:]
            scale = len(items) / max_items  # type: ignore[arg-type]
            items = sample
        stack.extend((child, depth + 1, through) for child in reversed(list(items)))
        if tally.attrs:
            stack.extend((v, depth, through | THROUGH["tensor_attr"]) for v in tally.attrs)
            tally.attrs.clear()
    return scale


def _numpy_owner_bytes(value: Any, tally: Tally) -> bool:
    """A numpy array that owns its memory: its bytes, once per buffer."""
    if type(value).__name__ != "ndarray" or type(value).__module__ != "numpy" or value.base is not None:
        return False
    key = ("numpy", int(value.__array_interface__["data"][0]))
    if key not in tally.storages:
        tally.storages.add(key)
        tally.bytes += int(value.nbytes)
    return True
