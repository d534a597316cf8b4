"""Unpickling a ``torch.distributed.checkpoint`` ``.metadata`` file another user may have written.

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain :mod:`pickle`: any code runs.
:func:`read_metadata` reads it (a regular file, bounded in size) with an unpickler that
resolves only:

- DCP's own dataclasses and enums, by their *defining* module (``cls.__module__`` under
  ``torch.distributed.checkpoint``): a class a DCP module merely imports (``enum.Enum``,
  pytree's ``TreeSpec``) is refused;
- ``torch.Size``, torch's dtypes and memory formats (by value), layouts (by name, through a
  lookup of devicekit's own instead of ``torch.serialization._get_layout`` and its cache),
  ``collections.OrderedDict`` and ``pathlib`` paths.

Modules are looked up in ``sys.modules``, never imported. The opcodes that act on objects are
checked too: ``NEWOBJ`` only makes a DCP dataclass; ``BUILD`` (``__setstate__`` or
``__dict__`` updates) only sets the state of an object this unpickling made, never of a
function, a class, an enum member or a dtype (all shared by the whole process); ``REDUCE`` only
calls the types above with plain arguments; ``APPEND``/``SETITEM`` only fill lists, dicts and
sets. So nothing outside the objects being built can change, even in a load that is refused.
Anything else is an :class:`~devicekit.errors.UnsafeCheckpointError` naming the file, before it
acts.

Usage::

    from devicekit.placement.dcp_metadata import read_metadata

    metadata = read_metadata(Path("ckpt/step-100/.metadata"))   # a DCP Metadata, or one line
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import io
import pathlib
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint  # noqa: F401  (DCP's modules, looked up in sys.modules)
from torch.distributed.checkpoint.metadata import Metadata

from devicekit.errors import CheckpointError, UnsafeCheckpointError
from devicekit.placement.dcp_files import read_bounded

__all__ = ["read_metadata", "MAX_METADATA_BYTES"]

#: the largest ``.metadata`` read (a checkpoint of 10,000 tensors on 1,024 ranks is far below)
MAX_METADATA_BYTES = 512 * 1024 * 1024
_DCP = "torch.distributed.checkpoint"
_PATHS = (pathlib.PosixPath, pathlib.PurePosixPath)


class _LayoutByName:
    """Stands in for ``torch.serialization._get_layout``: a layout by its name, no cache."""

    __slots__ = ()

    def __call__(self, name: object) -> torch.layout:
        for value in vars(torch).values():
            if isinstance(value, torch.layout) and str(value) == name:
                return value
        raise ValueError(f"no torch layout is named {name!r}")

    def __repr__(self) -> str:
        return "torch.serialization._get_layout"


_LAYOUT_BY_NAME = _LayoutByName()


def _dcp_class(module: str, value: object) -> bool:
    """A dataclass or enum that DCP itself defines (not one of its modules imports)."""
    defined_in = getattr(value, "__module__", "") if isinstance(value, type) else ""
    return ((module == _DCP or module.startswith(_DCP + "."))
            and isinstance(defined_in, str)
            and (defined_in == _DCP or defined_in.startswith(_DCP + "."))
            and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)))


def _describe(obj: object) -> str:
    if obj is _LAYOUT_BY_NAME:
        return repr(obj)
    if isinstance(obj, type) or callable(obj):
        name = getattr(obj, "__qualname__", None) or type(obj).__name__
        return f"{getattr(obj, '__module__', '?')}.{name}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__} object"


def _is_path(value: object) -> bool:
    return any(value is path for path in _PATHS)


def _plain_ints(value: object) -> bool:
    return isinstance(value, (tuple, list)) and all(
        type(item) is int for item in value)  # bool is not a dimension


class _MetadataUnpickler(pickle._Unpickler):  # the Python one: its opcodes can be checked
    """Unpickles DCP metadata; see the module docstring for what it admits."""

    def __init__(self, data: bytes, source: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.source = source
        self.made: dict[int, object] = {}  # id -> object: what NEWOBJ made here (kept alive)
        self.dataclasses: set[type] = set()  # DCP dataclasses met so far (checked once each)

    def refuse(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"sharded checkpoint metadata {str(self.source)!r} {what}; refused without running "
            "it (the file may be malicious)")

    def find_class(self, module: str, name: str) -> Any:
        found = sys.modules.get(module) if isinstance(module, str) else None
        value = vars(found).get(name) if found is not None and "." not in name else None
        if module == "torch.serialization" and name == "_get_layout":
            return _LAYOUT_BY_NAME
        if value is not None and module.split(".")[0] in ("torch", "collections", "pathlib"):
            if value is torch.Size or value is collections.OrderedDict or _is_path(value):
                return value
            if module == "torch" and isinstance(value, (torch.dtype, torch.memory_format,
                                                        torch.layout)):
                return value
            if _dcp_class(module, value):
                return value
        raise self.refuse(f"references {module}.{name}, which is not a checkpoint data type")

    def load_reduce(self) -> None:
        stack = self.stack
        args = stack.pop()
        func = stack[-1]
        stack[-1] = self._call(func, args)

    def _call(self, func: Any, args: Any) -> Any:
        if not isinstance(args, tuple):
            raise self.refuse(f"calls {_describe(func)} with {type(args).__name__} arguments")
        if func is torch.Size and (args == () or (len(args) == 1 and _plain_ints(args[0]))):
            return torch.Size(*args)
        if func is collections.OrderedDict and args == ():
            return collections.OrderedDict()
        if _is_path(func) and all(isinstance(part, str) for part in args):
            return func(*args)
        if func is _LAYOUT_BY_NAME and len(args) == 1 and isinstance(args[0], str):
            return func(args[0])
        if isinstance(func, type) and issubclass(func, enum.Enum) and len(args) == 1 \
                and _dcp_class(func.__module__, func):
            return func(args[0])  # a member lookup: the member is shared, so never BUILT on
        raise self.refuse(f"calls {_describe(func)}, which makes no checkpoint data")

    def _new(self, cls: Any, args: Any, kwargs: Any) -> None:
        known = isinstance(cls, type) and (cls in self.dataclasses or (
            dataclasses.is_dataclass(cls) and _dcp_class(cls.__module__, cls)))
        if not known or args != () or kwargs != {}:
            raise self.refuse(f"makes {_describe(cls)} with NEWOBJ, which is not a checkpoint "
                              "data class")
        self.dataclasses.add(cls)
        obj = cls.__new__(cls)
        self.made[id(obj)] = obj
        self.append(obj)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self._new(self.stack.pop(), args, {})

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self._new(self.stack.pop(), args, kwargs)

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if self.made.get(id(inst)) is not inst:
            raise self.refuse(f"sets the state of {_describe(inst)}, which it did not make "
                              "(BUILD on a shared object)")
        setstate = getattr(type(inst), "__setstate__", None)
        if setstate is not None:  # DCP's own (TensorProperties), on the object just made
            setstate(inst, state)
            return
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        for part in (state, slots):
            if part is None:
                continue
            if not isinstance(part, dict) or not all(
                    isinstance(key, str) and not key.startswith("__") for key in part):
                raise self.refuse(f"sets the state of {_describe(inst)} to something other "
                                  "than named fields")
        if state:
            inst.__dict__.update(state)
        fields = {field.name for field in dataclasses.fields(inst)} if slots else set()
        for key, value in (slots or {}).items():
            if key not in fields:
                raise self.refuse(f"sets {key!r}, which {_describe(inst)} has no field for")
            object.__setattr__(inst, key, value)

    def load_append(self) -> None:
        value = self.stack.pop()
        target = self.stack[-1]
        if type(target) is not list:
            raise self.refuse(f"appends to {_describe(target)}")
        target.append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is not list:
            raise self.refuse(f"appends to {_describe(target)}")
        target.extend(items)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._set_items([key, value])

    def load_setitems(self) -> None:
        self._set_items(self.pop_mark())

    def _set_items(self, items: list[Any]) -> None:
        target = self.stack[-1]
        if type(target) not in (dict, collections.OrderedDict):
            raise self.refuse(f"sets items of {_describe(target)}")
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def load_additems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is not set:
            raise self.refuse(f"adds items to {_describe(target)}")
        target.update(items)


def _refused_opcode(name: str) -> Any:
    def refuse(self: _MetadataUnpickler) -> None:
        raise self.refuse(f"uses the pickle opcode {name}, which checkpoint metadata never needs")
    return refuse


_MetadataUnpickler.dispatch = dict(pickle._Unpickler.dispatch)
for _name, _method in (("REDUCE", "load_reduce"), ("NEWOBJ", "load_newobj"),
                       ("NEWOBJ_EX", "load_newobj_ex"), ("BUILD", "load_build"),
                       ("APPEND", "load_append"), ("APPENDS", "load_appends"),
                       ("SETITEM", "load_setitem"), ("SETITEMS", "load_setitems"),
                       ("ADDITEMS", "load_additems")):
    _MetadataUnpickler.dispatch[getattr(pickle, _name)[0]] = getattr(_MetadataUnpickler, _method)
for _name in ("INST", "OBJ", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID", "NEXT_BUFFER",
              "READONLY_BUFFER"):
    if hasattr(pickle, _name):
        _MetadataUnpickler.dispatch[getattr(pickle, _name)[0]] = _refused_opcode(_name)


def read_metadata(path: Path) -> Any:
    """The DCP ``Metadata`` in the file ``path``, unpickled through the allow-list."""
    data = read_bounded(path, MAX_METADATA_BYTES, "sharded checkpoint metadata")
    try:
        metadata = _MetadataUnpickler(data, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # truncated, corrupt, wrong arguments to an allowed type
        raise CheckpointError(f"cannot read sharded checkpoint metadata {str(path)!r}: "
                              f"{type(exc).__name__}: {_one_line(exc)}; the file is "
                              "corrupt") from None
    if not isinstance(metadata, Metadata) or not isinstance(
            getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointError(f"sharded checkpoint metadata {str(path)!r} holds "
                              f"{_describe(metadata)}, not checkpoint metadata; the file is "
                              "corrupt")
    return metadata


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200]
