"""Name the path from a user's variable to a surviving tensor, the way the user would write it.

:func:`find_paths` searches breadth-first from named roots (a loop's locals and globals, a step
function's closure, ``watch=`` objects) through every kind of reference that keeps a tensor
alive in a training script: attributes, container items, submodules, module hook dicts and
``_buffers``, optimizer ``param_groups`` and ``state``, functions' closure cells and default
arguments, ``lru_cache`` results, bound methods and ``functools.partial``, exceptions (their
traceback frames, ``__cause__`` and ``__context__``), suspended generators' and coroutines'
frames, tensors' own attributes (``out.prev``), the tensor behind a numpy array made by
``.numpy()``, and user-defined classes (class attributes), reached from their instances.
The shortest path to each target wins; a search is bounded by ``budget`` objects.

Each :class:`Edge` knows how to be followed again (``step``, for
:func:`~devicekit.memory.paths.resolve`) when it can be: a holder found once is then re-read
cheaply at every step.

Usage::

    from devicekit.memory.leaks.reach import find_paths
    from devicekit.memory.roots import frame_roots

    paths = find_paths({id(t): t}, frame_roots(frame))
    root, edges = paths[id(t)]
    print(root.name + "".join(e.label for e in edges))    # model.1._forward_hooks[3].<closure feats>[0]
"""

from __future__ import annotations

import collections
import functools
import gc
import sys
import types
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch

from devicekit.memory.paths import MODULE_INTERNALS
from devicekit.memory.roots import MISSING, Root, is_user_file

__all__ = ["Edge", "find_paths", "is_user_class", "kept_frames", "numpy_base", "HOOK_DICTS", "LRU_TYPE", "GENERATORS"]

#: module attributes that hold hooks: a hook registered every step grows one of these
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
              "_state_dict_hooks", "_load_state_dict_pre_hooks")
LRU_TYPE = type(functools.lru_cache(maxsize=None)(lambda: None))
#: suspended generators and coroutines keep their frame, and so its locals, alive
GENERATORS = (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)
_LIBRARY_TYPES = (types.ModuleType, types.CodeType, types.BuiltinFunctionType, str, bytes, int,
                  float, complex, bool, type(None), range)


class Edge(NamedTuple):
    """One reference: ``label`` as printed, ``step`` to follow it again (None: cannot be)."""

    label: str
    step: tuple[str, Any] | None
    value: Any


def _key_label(key: Any) -> str:
    if isinstance(key, str):
        return f"[{key!r}]"
    if isinstance(key, (int, bool)):
        return f"[{key}]"
    return "[...]"


_user_types: dict[type, bool] = {}


def is_user_class(cls: type) -> bool:
    """A class defined in user code (not the stdlib, torch, or devicekit)."""
    found = _user_types.get(cls)
    if found is None:
        module = sys.modules.get(getattr(cls, "__module__", "") or "")
        filename = getattr(module, "__file__", None) or ""
        found = bool(filename) and is_user_file(filename)
        _user_types[cls] = found
    return found


def _is_user_function(fn: Any) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and is_user_file(code.co_filename)


def numpy_base(value: Any) -> Any:
    """The object a numpy array's memory belongs to (the tensor behind ``t.numpy()``, the array
    a view was taken of); None for anything else, and for an array that owns its memory."""
    cls = type(value)
    if cls.__name__ != "ndarray" or cls.__module__ != "numpy":
        return None
    return value.base


def kept_frames(frame: types.FrameType | None) -> list[types.FrameType]:
    """``frame`` and the callers it keeps alive: a finished frame held by a traceback keeps its
    ``f_back`` chain (a framework's loop frames, with their locals) up to the first frame that
    is still running (those are alive anyway)."""
    running = set()
    current: types.FrameType | None = sys._getframe(1)
    while current is not None:
        running.add(id(current))
        current = current.f_back
    kept = []
    while frame is not None and id(frame) not in running and len(kept) < 64:
        kept.append(frame)
        frame = frame.f_back
    return kept


def _frame_of(gen: Any) -> types.FrameType | None:
    return getattr(gen, "gi_frame", None) or getattr(gen, "cr_frame", None) or getattr(gen, "ag_frame", None)


def children(obj: Any, max_items: int = 10_000) -> Iterator[Edge]:
    """The named references of ``obj`` that can keep a tensor alive."""
    if isinstance(obj, torch.Tensor):
        for key, value in list(getattr(obj, "__dict__", {}).items()):  # `out.prev = last_out`
            yield Edge(f".{key}", ("attr", key), value)
        return
    if isinstance(obj, torch.nn.Module):
        yield from _module_children(obj)
    elif isinstance(obj, torch.optim.Optimizer):
        yield Edge(".param_groups", ("attr", "param_groups"), obj.param_groups)
        yield Edge(".state", ("attr", "state"), obj.state)
    elif isinstance(obj, dict):
        for index, (key, value) in enumerate(list(obj.items())):
            if index >= max_items:
                break
            step = ("item", key) if isinstance(key, (str, int)) else None
            yield Edge(_key_label(key), step, value)
    elif isinstance(obj, (list, tuple, collections.deque)):
        for index, value in enumerate(list(obj)[-max_items:] if len(obj) > max_items else obj):
            yield Edge(f"[{index}]", ("item", index) if not isinstance(obj, collections.deque) else None, value)
    elif isinstance(obj, (set, frozenset)):
        for value in list(obj)[:max_items]:
            yield Edge("{...}", None, value)
    elif isinstance(obj, LRU_TYPE):
        yield from _lru_children(obj)
    elif isinstance(obj, types.FunctionType):
        yield from _function_children(obj)
    elif isinstance(obj, types.MethodType):
        yield Edge(".__self__", None, obj.__self__)
        yield Edge(".__func__", None, obj.__func__)
    elif isinstance(obj, functools.partial):
        for index, value in enumerate(obj.args):
            yield Edge(f".args[{index}]", None, value)
        for key, value in obj.keywords.items():
            yield Edge(f".keywords[{key!r}]", None, value)
    elif isinstance(obj, BaseException):
        yield Edge(".__traceback__", None, obj.__traceback__)
        yield Edge(".__context__", None, obj.__context__)
        yield Edge(".__cause__", None, obj.__cause__)
        yield Edge(".args", None, obj.args)
    elif isinstance(obj, types.TracebackType):
        yield Edge(".tb_frame", None, obj.tb_frame)
        yield Edge(".tb_next", None, obj.tb_next)
        for index, frame in enumerate(kept_frames(obj.tb_frame)[1:], 1):  # callers, framework's too
            yield Edge(".tb_frame" + ".f_back" * index, None, _Locals(frame))
    elif isinstance(obj, GENERATORS):
        frame = _frame_of(obj)
        if frame is not None:
            yield Edge(".gi_frame", None, frame)
    elif isinstance(obj, types.FrameType):
        if is_user_file(obj.f_code.co_filename):
            for key, value in list(obj.f_locals.items()):
                yield Edge(f".f_locals[{key!r}]", None, value)
    elif isinstance(obj, _Locals):
        for key, value in list(obj.frame.f_locals.items()):
            yield Edge(f".f_locals[{key!r}]", None, value)
    elif isinstance(obj, type):
        if is_user_class(obj):
            for key, value in list(vars(obj).items()):
                if not key.startswith("__"):
                    yield Edge(f".{key}", ("attr", key), value)
    elif (base := numpy_base(obj)) is not None:
        yield Edge(".base", None, base)
    else:
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            for key, value in list(attrs.items()):
                if isinstance(key, str) and not key.startswith("__"):
                    yield Edge(f".{key}", ("attr", key), value)


class _Locals(NamedTuple):
    """A finished frame whose locals are followed even in library code (kept by a traceback)."""

    frame: types.FrameType


def _module_children(module: torch.nn.Module) -> Iterator[Edge]:
    for key, value in vars(module).items():
        if key in MODULE_INTERNALS or key.startswith("__"):
            continue
        yield Edge(f".{key}", ("attr", key), value)
    for key, child in module._modules.items():
        if child is not None:
            yield Edge(f".{key}", ("attr", key), child)
    yield Edge("._buffers", ("attr", "_buffers"), module._buffers)
    for name in HOOK_DICTS:
        hooks = getattr(module, name, None)
        if hooks:
            yield Edge(f".{name}", ("attr", name), hooks)


def _function_children(fn: types.FunctionType) -> Iterator[Edge]:
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        yield Edge(f".<closure {name}>", ("cell", name), value)
    for index, value in enumerate(fn.__defaults__ or ()):
        yield Edge(f".__defaults__[{index}]", ("default", index), value)
    for key, value in (fn.__kwdefaults__ or {}).items():
        yield Edge(f".__kwdefaults__[{key!r}]", ("kwdefault", key), value)
    for key, value in vars(fn).items():
        yield Edge(f".{key}", ("attr", key), value)


def _lru_children(wrapper: Any) -> Iterator[Edge]:
    # the C lru_cache keeps its results in list nodes the garbage collector does not track;
    # its traverse function visits them, so gc.get_referents sees every key and result
    wrapped = getattr(wrapper, "__wrapped__", None)
    for value in gc.get_referents(wrapper):
        if value is wrapped or isinstance(value, type):
            continue
        yield Edge(".<lru_cache result>", None, value)
    if wrapped is not None:
        yield Edge(".__wrapped__", ("attr", "__wrapped__"), wrapped)


def _worth_visiting(value: Any) -> bool:
    if isinstance(value, _LIBRARY_TYPES):
        return False
    if isinstance(value, types.FunctionType):
        return _is_user_function(value)
    if isinstance(value, type):
        return is_user_class(value)
    return not type(value).__module__.startswith("devicekit.")


def find_paths(targets: dict[int, Any], roots: Iterable[Root], *, budget: int = 20_000,
               max_depth: int = 12) -> dict[int, tuple[Root, list[Edge]]]:
    """Shortest named path from ``roots`` to each target (``{id: object}``) reachable within
    ``budget`` visited objects; targets not reached are absent."""
    found: dict[int, tuple[Root, list[Edge]]] = {}
    seen: set[int] = set()
    queue: deque[tuple[Root, list[Edge], Any]] = deque()
    classes: list[type] = []
    for root in roots:
        value = root.get()
        try:
            if value is MISSING or not _worth_visiting(value) and id(value) not in targets:
                continue
        except Exception:  # noqa: BLE001 - a dead weak proxy, an object with an odd __class__
            continue
        queue.append((root, [], value))
    visited = 0
    while queue and len(found) < len(targets) and visited < budget:
        root, edges, value = queue.popleft()
        if id(value) in seen:
            continue
        seen.add(id(value))
        visited += 1
        if id(value) in targets:
            found.setdefault(id(value), (root, edges))
            continue
        if len(edges) >= max_depth:
            continue
        cls = type(value)
        if cls not in classes and is_user_class(cls) and not issubclass(cls, type):
            classes.append(cls)
            queue.append((Root(cls.__name__, "class", (lambda c=cls: c)), [], cls))
        try:  # user objects run code here (__getattr__, dead weak proxies): never fail the loop
            for edge in children(value):
                child = edge.value
                if id(child) in seen:
                    continue
                if id(child) in targets or _worth_visiting(child):
                    queue.append((root, [*edges, edge], child))
        except Exception:  # noqa: BLE001 - one object's odd behaviour ends only its own walk
            continue
    return found
