"""From surviving memory to named holders: the leak finder's search for what keeps a tensor.

Each step, :class:`~devicekit.memory.leaks.survivors.SurvivorWatch` lists the tensors that
outlived the two steps after the one that made them. Those already inside a measured holder are
explained; for the rest :func:`~devicekit.memory.leaks.reach.find_paths` finds the shortest
named path from the loop's variables, and every container (or exception) on that path that can
be re-read by name (``model.1._forward_hooks``, ``MyModel.cache``, ``opt.param_groups``,
``pending_logs``, an ``lru_cache``, ``self.last_error``; and, for a tensor kept directly under an
object's attribute, that object's ``__dict__`` or a module's ``_modules``) becomes a holder, measured from then on
like the ones named up front. Which of them leaks is left to the measurement: only the container
that gains something every step grows. Searches are bounded: a kind of tensor (dtype, shape,
autograd state) found nowhere is searched again at most every few steps; such unnamed survivors
are followed by weak reference, and those still alive at the report are what
:meth:`HolderDiscovery.unnamed_series` counts (a leak of its own: no holder found).

:func:`closure_roots` gives a hand-written loop the names ``find_leaks`` reads from the step
function itself: its closure cells and the globals it uses.

Usage::

    found = HolderDiscovery()
    found.scan(step)                                  # after the step's garbage collection
    new = found.search(unexplained, roots, step)      # {path: Holder}, also in found.holders
    found.pattern("model.1._forward_hooks")           # ("[3].<closure feats>[0]", False)
"""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref
from typing import Any

import torch

from devicekit.memory.leaks.holders import NOT_NAMESPACES, Holder
from devicekit.memory.leaks.reach import LRU_TYPE, Edge, find_paths, is_user_class
from devicekit.memory.leaks.survivors import SurvivorWatch, signature
from devicekit.memory.paths import CONTAINERS
from devicekit.memory.roots import MISSING, Root, function_roots, is_user_file
from devicekit.memory.tensors import total_bytes

__all__ = ["HolderDiscovery", "closure_roots", "code_roots", "method_roots"]

_RETRY_EVERY = 3  # steps between searches for one kind of tensor
#: user class -> (name, module globals) of the globals its methods name (read when needed)
_method_globals: weakref.WeakKeyDictionary[type, list[tuple[str, dict[str, Any]]]] = weakref.WeakKeyDictionary()


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


def closure_roots(namespace: dict[str, Any], taken: set[str]) -> list[Root]:
    """What the user functions in ``namespace`` can keep across calls (their closure cells and
    the globals they name), by the names ``find_leaks`` gives them from the step function
    itself (``running``, not ``step.<closure running>``): a hand-written loop over the same step
    gives the same answer. Names in ``taken`` (the loop's own variables) win."""
    roots = []
    for value in list(namespace.values()):
        if type(value) is not types.FunctionType or not is_user_file(value.__code__.co_filename):
            continue
        for root in function_roots(value):
            if root.name not in taken:
                taken.add(root.name)
                roots.append(root)
    return roots


def method_roots(values: list[Any], taken: set[str]) -> list[Root]:
    """The module globals the methods of user objects among ``values`` name (``global last_out``
    in a LightningModule's ``training_step``, or in a helper method it calls), by their global
    names, as ``find_leaks`` names the globals of a step function: a framework's callback sees
    only ``self`` and ``model``, and the same leak gets the same name. Names in ``taken`` win."""
    roots = []
    for value in values:
        cls = type(value)  # not isinstance: a dead weak proxy raises on __class__
        if cls.__module__.startswith("devicekit.") or not is_user_class(cls):
            continue
        named = _method_globals.get(cls)
        if named is None:
            named = _method_globals[cls] = _globals_named_by_methods(cls)
        for name, namespace in named:
            if name not in taken:
                taken.add(name)
                roots.append(Root(name, "global", functools.partial(_read_global, namespace, name)))
    return roots


def _globals_named_by_methods(cls: type) -> list[tuple[str, dict[str, Any]]]:
    found: dict[str, dict[str, Any]] = {}
    for klass in cls.__mro__:
        if klass is object or not is_user_class(klass):
            continue
        for attr in vars(klass).values():
            fn = getattr(attr, "__func__", attr)  # staticmethod, classmethod
            if type(fn) is not types.FunctionType or not is_user_file(fn.__code__.co_filename):
                continue
            for root in function_roots(fn):
                if root.origin == "global" and root.name not in found:
                    found[root.name] = fn.__globals__
    return sorted(found.items(), key=lambda item: item[0])


def _read_global(namespace: dict[str, Any], name: str) -> Any:
    value = namespace.get(name, MISSING)
    return MISSING if isinstance(value, (type, types.ModuleType, types.FunctionType)) else value


class HolderDiscovery:
    """See the module docstring."""

    def __init__(self) -> None:
        self.survivors = SurvivorWatch()
        self.holders: dict[str, Holder] = {}
        self._via: dict[str, str] = {}
        self._lru: set[str] = set()
        self._searched: dict[tuple[Any, ...], int] = {}  # signature -> last step searched
        self._failed: set[tuple[Any, ...]] = set()  # signatures a search found no path to
        # survivors found nowhere, by weak reference: (step, tensor); judged by what is still alive
        self._unnamed: list[tuple[int, weakref.ref[torch.Tensor]]] = []
        self.roots_searched = 0
        #: ids of measured holders a survivor was found in (the last search's): re-measure them
        self.through_held: set[int] = set()
        self.searches = 0

    def scan(self, step: int) -> list[torch.Tensor]:
        return self.survivors.scan(step)

    def pattern(self, path: str) -> tuple[str, bool]:
        """``(via, is_lru)`` for a discovered holder: the path from it to the tensor it keeps."""
        return self._via.get(path, ""), path in self._lru

    def search(self, unexplained: list[torch.Tensor], roots: list[Root], step: int,
               held: set[int], *, fixed_roots: bool = False) -> dict[str, Holder]:
        """Name the holders of ``unexplained`` survivors; ``held``: ids of values already measured;
        ``fixed_roots``: the roots stay valid (``find_leaks``), so holders under a local name
        keep theirs (a loop's frame roots do not: a callback's frame is new every step)."""
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
        self.through_held = set()
        self.roots_searched = max(self.roots_searched, len(roots))
        paths = find_paths(targets, roots)
        new: dict[str, Holder] = {}
        for root, edges in paths.values():
            for path, holder, via in _candidates(root, edges):
                value = holder.get()
                if path in self.holders or id(value) in held:
                    self.through_held.add(id(value))  # measured from a cache: measure it afresh
                    continue
                held.add(id(value))
                new[path] = holder
                # a local name is kept without its frame; the detector reads it from the current one
                self.holders[path] = holder if holder.origin != "local" or fixed_roots else dataclasses.replace(
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
        for tensor in tensors:
            try:
                self._unnamed.append((step, weakref.ref(tensor)))
            except TypeError:  # a tensor subclass without weak references
                continue

    def unnamed_series(self, warmup: int, last: int) -> tuple[list[int], str]:
        """Bytes of unnamed survivors still alive now, summed over the steps that left them,
        after warm-up; and what they are (dtype, shape, autograd state of the most common kind).
        A survivor that died since is no leak."""
        alive: dict[int, list[torch.Tensor]] = {}
        for step, ref in self._unnamed:
            tensor = ref()
            if tensor is not None and warmup <= step <= last:
                alive.setdefault(step, []).append(tensor)
        total, series = 0, []
        for step in range(max(warmup, 2), last + 1):
            total += total_bytes(alive.get(step, []))
            series.append(total)
        kinds: dict[tuple[Any, ...], int] = {}
        for tensors in alive.values():
            for tensor in tensors:
                kinds[signature(tensor)] = kinds.get(signature(tensor), 0) + 1
        del alive
        if not kinds:
            return series, ""
        dtype, shape, device, requires_grad, grad_fn = max(kinds, key=kinds.__getitem__)
        what = f"{str(dtype).replace('torch.', '')} {list(shape)} tensors on {device}"
        if grad_fn:
            what += f" with grad_fn {grad_fn}"
        elif requires_grad:
            what += " that require grad"
        return series, what

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
    names: tuple[str, Holder, str] | None = None  # the last object whose attribute keeps it
    for index, value in enumerate(values[:-1]):  # the last value is the tensor itself
        if index > 0:
            step = edges[index - 1].step
            if step is None:
                resolvable = False
            else:
                steps.append(step)
        if not resolvable:
            break
        if isinstance(value, (*CONTAINERS, LRU_TYPE, BaseException)):
            path = root.name + "".join(edge.label for edge in edges[:index])
            in_module = index > 0 and isinstance(values[index - 1], torch.nn.Module)
            via = "".join(edge.label for edge in edges[index:])
            found.append((path, Holder(path, root.origin, in_module, root, tuple(steps)), via))
            names = None
        elif (attrs := _attribute_dict(value, edges[index].step)) is not None:
            # kept under an attribute of an object (no container of the user's after it): that
            # object's attribute dict (or a module's `_modules`) holds it, and grows if a new
            # name is added every step (`setattr(obj, f"act_{step}", h)`)
            path = root.name + "".join(edge.label for edge in edges[:index]) + "." + attrs
            via = "".join(edge.label for edge in edges[index:])
            names = (path, Holder(path, root.origin, isinstance(value, torch.nn.Module), root,
                                  (*steps, ("attr", attrs))), via)
    if names is not None:
        found.append(names)
    return found


def _attribute_dict(value: Any, step: tuple[str, Any] | None) -> str | None:
    """``"__dict__"`` or ``"_modules"``: which attribute dict of ``value`` the attribute
    ``step`` reads; None when ``step`` reads no instance attribute of an object."""
    if step is None or step[0] != "attr" or issubclass(type(value), NOT_NAMESPACES):
        return None
    try:
        attrs = vars(value)
    except Exception:  # noqa: BLE001 - no __dict__, or an object that fails to give it
        return None
    if type(attrs) is not dict:
        return None
    if step[1] in attrs:
        return "__dict__"
    submodules = attrs.get("_modules")
    if isinstance(value, torch.nn.Module) and type(submodules) is dict and step[1] in submodules:
        return "_modules"
    return None
