"""Named roots: the variables a person would use to name memory (locals, globals, closures).

A :class:`Root` pairs a name with a way to read its current value, so a holder found once can
be re-read cheaply later (the leak finder does so at every step and, with line attribution, at
every traced line). Frames and functions from the standard library, site-packages and devicekit
itself are not user code and are skipped.

Usage::

    import sys
    from devicekit.memory.roots import frame_roots, function_roots, is_user_file

    for root in frame_roots(sys._getframe()):
        print(root.name, root.origin, type(root.get()))
"""

from __future__ import annotations

import functools
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Root", "MISSING", "frame_roots", "function_roots", "user_frames", "is_user_file", "is_plain_value"]

#: returned by :attr:`Root.get` when the name no longer exists
MISSING: Any = object()

_DEVICEKIT_DIR = str(Path(__file__).resolve().parents[1])
_LIBRARY_DIRS = tuple(
    {str(Path(p).resolve()) for key in ("stdlib", "platstdlib", "purelib", "platlib")
     if (p := sysconfig.get_paths().get(key))}
)
_user_cache: dict[str, bool] = {}


def is_user_file(filename: str) -> bool:
    """True for code a user wrote: not the stdlib, not site-packages, not devicekit."""
    found = _user_cache.get(filename)
    if found is None:
        if filename.startswith("<"):
            found = not filename.startswith("<frozen")
        else:
            resolved = str(Path(filename).resolve())
            found = not resolved.startswith(_LIBRARY_DIRS + (_DEVICEKIT_DIR,)) and "site-packages" not in resolved
        _user_cache[filename] = found
    return found


@dataclass(frozen=True)
class Root:
    """A named variable: ``origin`` is ``local``, ``global``, ``closure`` or ``self``."""

    name: str
    origin: str
    get: Callable[[], Any]


_SKIP_TYPES = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
               type, types.CodeType, types.FrameType)


_PLAIN = (int, float, complex, str, bytes, bool, type(None)) + _SKIP_TYPES
_plain_types: dict[type, bool] = {}


def is_plain_value(value: Any) -> bool:
    """Values that cannot hold tensors: numbers, strings, functions, modules, classes."""
    cls = type(value)
    found = _plain_types.get(cls)
    if found is None:
        found = _plain_types[cls] = issubclass(cls, _PLAIN)
    return found


def frame_roots(frame: types.FrameType, *, include_globals: bool = True) -> list[Root]:
    """The locals of ``frame`` (and its module globals, when ``include_globals``)."""
    origin = "global" if frame.f_locals is frame.f_globals else "local"  # module-level code
    roots = [
        Root(name, origin, _frame_getter(frame, name))
        for name, value in frame.f_locals.items()
        if not is_plain_value(value) and not name.startswith("__")
    ]
    if include_globals:
        local_names = {root.name for root in roots}
        roots.extend(
            Root(name, "global", _dict_getter(frame.f_globals, name))
            for name, value in frame.f_globals.items()
            if name not in local_names and not name.startswith("__") and not is_plain_value(value)
        )
    return roots


def function_roots(fn: Callable[..., Any]) -> list[Root]:
    """What a step function can reach across calls: its globals, closure cells, bound ``self``."""
    if isinstance(fn, functools.partial):
        bound = [Root(f"args[{i}]", "closure", (lambda v=v: v)) for i, v in enumerate(fn.args)]
        bound += [Root(k, "closure", (lambda v=v: v)) for k, v in fn.keywords.items()]
        return function_roots(fn.func) + bound
    roots: list[Root] = []
    bound_self = getattr(fn, "__self__", None)
    func = getattr(fn, "__func__", fn)
    if bound_self is not None and not isinstance(bound_self, types.ModuleType):
        roots.append(Root("self", "self", lambda: bound_self))
    code = getattr(func, "__code__", None)
    if code is None:  # a callable object: its attributes are its state, its __call__ the code
        if hasattr(fn, "__dict__"):
            roots.append(Root("self", "self", lambda: fn))
        call = vars(type(fn)).get("__call__")  # defined in Python on the class itself
        if isinstance(call, types.FunctionType):
            roots.extend(r for r in function_roots(call) if r.origin == "global")
        return roots
    for name, cell in zip(code.co_freevars, func.__closure__ or (), strict=False):
        roots.append(Root(name, "closure", _cell_getter(cell)))
    module_globals = func.__globals__
    for name in sorted(_global_names(code)):
        # values are judged when read, not now: `total_loss = 0` becomes a tensor on step 1
        if not isinstance(module_globals.get(name), _SKIP_TYPES):
            roots.append(Root(name, "global", _dict_getter(module_globals, name)))
    return roots


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def user_frames(start: types.FrameType | None = None) -> Iterator[types.FrameType]:
    """Frames of user code from ``start`` (default: the caller) outwards."""
    frame = start if start is not None else sys._getframe(1)
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            yield frame
        frame = frame.f_back


def _frame_getter(frame: types.FrameType, name: str) -> Callable[[], Any]:
    return lambda: frame.f_locals.get(name, MISSING)


def _dict_getter(namespace: dict[str, Any], name: str) -> Callable[[], Any]:
    return lambda: namespace.get(name, MISSING)


def _cell_getter(cell: types.CellType) -> Callable[[], Any]:
    def get() -> Any:
        try:
            return cell.cell_contents
        except ValueError:  # empty cell
            return MISSING

    return get
