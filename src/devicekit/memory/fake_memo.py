"""The outputs of ops on fake tensors, remembered by what the outputs can depend on.

Under ``FakeTensorMode`` an op's outputs are fake tensors whose shape, stride, dtype and device
follow from its inputs' metadata and its other arguments, never from values. torch's own cache
of them keys on every input's full metadata, storage offset included, and building that key is
most of a fake dispatch (~0.1 ms): an RNN's time steps read their states at a new offset each
step, so a long sequence missed it step after step. This memo keys on less, in one plain tuple,
and builds the outputs the way torch's cache does (empty meta tensors wrapped as fake):

* an op that makes new tensors (``add``, ``mm``) is keyed without storage offsets, which an op
  that neither aliases nor writes cannot depend on;
* an in-place op (``add_``: writes its first argument, returns it) gives back that argument;
* an op that returns views (``t``, ``select``, and ``unsafe_split``, which says nothing of it in
  its schema and is found out the first time) is keyed with offsets, and its outputs are built
  on the argument's storage at the offsets seen.

Remembered only what is safe to replay: a builtin op (``aten``/``prims``) not tagged
data-dependent, dynamic-shaped or an in-place view, that writes no argument but an in-place
op's first; every tensor argument a plain fake tensor (no constant riding along, strided, not
conjugated or negated), every other argument a plain value; and outputs that each own a fresh
storage of exactly their size, or lie on one argument's storage. Anything else is dispatched
every time, as before. ``tests/memory/test_fake_memo.py`` replays every op of the estimate's
zoo against the real dispatch.

Usage::

    from devicekit.memory.fake_memo import OpMemo

    memo = OpMemo(fake_mode)
    out = memo.replay(func, args, kwargs)          # inside a dispatch mode above fake_mode
    if out is memo.MISS:
        out = func(*args, **kwargs)
        memo.remember(func, args, kwargs, out)
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager

__all__ = ["OpMemo"]

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_UNSAFE_TAGS = tuple(getattr(torch.Tag, name) for name in
                     ("data_dependent_output", "dynamic_output_shape", "inplace_view")
                     if hasattr(torch.Tag, name))
_SKIP, _NEW, _INPLACE = "skip", "new", "in place"
# an output: ("new", shape, stride, dtype, device, requires_grad) or ("on", argument index,
# shape, stride, offset, dtype, device, requires_grad); None for an output that is None
_Out = tuple[Any, ...]


class _Unkeyable(Exception):
    """An argument the memo does not key on: dispatch the op as usual."""


class OpMemo:
    """Outputs of ops under one ``FakeTensorMode``, by their inputs' metadata and arguments."""

    MISS = object()

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        self.mode = fake_mode
        self.entries: dict[tuple[Any, ...], Any] = {}
        self.hits = 0
        self._kinds: dict[Any, str] = {}
        self._offsets: set[Any] = set()     # ops keyed with storage offsets: they return views

    def replay(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)``'s outputs if it was seen with such inputs, else MISS."""
        key = self._key(func, args, kwargs)
        entry = self.entries.get(key) if key is not None else None
        if entry is None:
            return self.MISS
        self.hits += 1
        return args[0] if entry == _INPLACE else self._materialize(entry, args)

    def remember(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Keep what ``out`` is made of, for the next call with such inputs, if it is safe to replay."""
        key = self._key(func, args, kwargs)
        if key is None or key in self.entries:
            return
        if self._kinds[func] == _INPLACE:
            if out is args[0]:
                self.entries[key] = _INPLACE
            return
        inputs = _tensors(args)
        entry = self._describe(func, out, inputs)
        # kept only if what it builds is what the op gave, down to the dispatch keys
        if entry is not None and _same(self._materialize(entry, args), out, inputs):
            self.entries[key] = entry

    def _kind(self, func: Any) -> str:
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _classify(func)
            if kind == _NEW and any(r.alias_info is not None for r in func._schema.returns):
                self._offsets.add(func)   # a view by its schema
        return kind

    def _key(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        if self._kind(func) == _SKIP:
            return None
        parts: list[Any] = [func]
        offsets = func in self._offsets
        try:
            _add(parts, args, offsets, self.mode)
            if kwargs:
                for name in sorted(kwargs):
                    parts.append(name)
                    _add(parts, kwargs[name], offsets, self.mode)
        except _Unkeyable:
            return None
        return tuple(parts)

    def _describe(self, func: Any, out: Any, inputs: list[torch.Tensor]) -> Any:
        """``out`` as outputs to build, or None if it is not safe to replay."""
        if isinstance(out, torch.Tensor):
            kind, items = "tensor", [out]
        elif isinstance(out, (tuple, list)) and out:
            kind, items = ("list" if isinstance(out, list) else "tuple"), list(out)
        else:
            return None
        storages = {_storage_id(t): index for index, t in enumerate(inputs)}
        made: set[int] = set()
        outs: list[_Out | None] = []
        for item in items:
            if item is None:
                outs.append(None)
                continue
            described = _output(item, storages, made)
            if described is None:
                return None
            if described[0] == "on" and func not in self._offsets:
                self._offsets.add(func)   # a view its schema does not name: key it with offsets
                return None
            outs.append(described)
        return kind, (outs[0] if kind == "tensor" else tuple(outs))

    def _materialize(self, entry: Any, args: tuple[Any, ...]) -> Any:
        kind, outs = entry
        if kind == "tensor":
            return self._build(outs, args)
        made = [None if out is None else self._build(out, args) for out in outs]
        return made if kind == "list" else tuple(made)

    def _build(self, out: _Out, args: tuple[Any, ...]) -> FakeTensor:
        if out[0] == "new":
            _, shape, stride, dtype, device, requires_grad = out
            with in_kernel_invocation_manager(self.mode):
                empty = torch.empty_strided(shape, stride, dtype=dtype, device="meta",
                                            requires_grad=requires_grad)
            return FakeTensor(self.mode, empty, device)
        _, index, shape, stride, offset, dtype, device, requires_grad = out
        storage = _tensors(args)[index].untyped_storage()
        with in_kernel_invocation_manager(self.mode):
            view = torch.empty_strided(shape, stride, dtype=dtype, device="meta", requires_grad=requires_grad)
            view.set_(storage, offset, shape, stride)
        return FakeTensor(self.mode, view, device)


def _classify(func: Any) -> str:
    """_NEW (writes nothing), _INPLACE (writes and returns its first argument) or _SKIP."""
    schema = getattr(func, "_schema", None)
    if (schema is None or getattr(func, "namespace", "") not in ("aten", "prims")
            or any(tag in func.tags for tag in _UNSAFE_TAGS)
            or "resize" in func.name()):     # _resize_output_ changes its argument's shape, untagged
        return _SKIP
    written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    if not written:
        return _NEW
    returns = schema.returns
    if (written == [0] and len(returns) == 1 and returns[0].alias_info is not None
            and returns[0].alias_info.is_write
            and returns[0].alias_info.before_set == schema.arguments[0].alias_info.before_set):
        return _INPLACE
    return _SKIP


def _add(parts: list[Any], value: Any, offsets: bool, mode: FakeTensorMode) -> None:
    """Append what ``value`` contributes to a key; raise _Unkeyable for what it cannot hold."""
    if type(value) is FakeTensor:
        if (value.fake_mode is not mode or value.constant is not None or value.layout != torch.strided or value.is_conj()
                or value.is_neg()):
            raise _Unkeyable
        parts.append((tuple(value.shape), value.stride(), value.dtype, value.fake_device,
                      value.requires_grad, value.storage_offset() if offsets else None))
    elif isinstance(value, _PLAIN):
        parts.append((type(value), value))
    elif isinstance(value, (tuple, list)):
        parts.append(len(value))
        for item in value:
            _add(parts, item, offsets, mode)
    else:   # a real tensor, a generator, a SymInt, anything else: not keyed
        raise _Unkeyable


def _tensors(args: Any) -> list[torch.Tensor]:
    """The tensors in ``args`` (nested tuples / lists), in order. No recursive closure: a nested
    function that calls itself is a reference cycle, which would keep the tensors it saw alive
    until the garbage collector ran, and under the tracker that is memory in use."""
    found: list[torch.Tensor] = []
    stack = [args]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            stack.extend(reversed(value))
    return found


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _same(made: Any, out: Any, inputs: list[torch.Tensor]) -> bool:
    """Whether ``made`` (built from an entry) matches ``out`` (the op's own outputs) in everything
    a later op or the tracker can see: metadata, dispatch keys, and which storage each lies on."""
    if type(made) is not type(out):
        return False
    if not isinstance(out, torch.Tensor) and len(made) != len(out):
        return False
    pairs = [(made, out)] if isinstance(out, torch.Tensor) else list(zip(made, out, strict=True))
    storages = [_storage_id(t) for t in inputs]
    for a, b in pairs:
        if a is None or b is None:
            if a is not b:
                return False
            continue
        sa, sb = a.untyped_storage(), b.untyped_storage()
        on_a = [i for i, s in enumerate(storages) if s == sa._cdata]
        on_b = [i for i, s in enumerate(storages) if s == sb._cdata]
        if ((a.shape, a.stride(), a.storage_offset(), a.dtype, a.fake_device, a.requires_grad, on_a,
             sa.nbytes(), torch._C._dispatch_key_set(a))
                != (b.shape, b.stride(), b.storage_offset(), b.dtype, b.fake_device, b.requires_grad, on_b,
                    sb.nbytes(), torch._C._dispatch_key_set(b))):
            return False
    return True


def _output(t: Any, storages: dict[int, int], made: set[int]) -> _Out | None:
    """How to build ``t`` again: a fresh storage of exactly its size at offset 0 ("new"), or a
    view of argument ``storages[...]``'s storage ("on"); None if neither."""
    if (type(t) is not FakeTensor or t.constant is not None or t.layout != torch.strided
            or t.is_conj() or t.is_neg()):
        return None
    shape, stride, offset = tuple(t.shape), t.stride(), t.storage_offset()
    if not all(type(n) is int for n in (*shape, *stride, offset)):
        return None
    storage = t.untyped_storage()
    ident = storage._cdata
    if ident in storages:
        return ("on", storages[ident], shape, stride, offset, t.dtype, t.fake_device, t.requires_grad)
    needed = 0 if 0 in shape else (1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))) * t.element_size()
    if offset != 0 or storage.nbytes() != needed or ident in made:
        return None
    made.add(ident)
    return ("new", shape, stride, t.dtype, t.fake_device, t.requires_grad)
