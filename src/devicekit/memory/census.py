"""Census of live tensors: what holds memory, grouped by device/dtype/shape and by name.

Parameters, buffers and gradients are named by module path (``model.encoder.0.weight``),
optimizer state by parameter (``optimizer.state[model.0.weight].exp_avg``), everything else by
what refers to it: a local variable (``x`` in ``forward``), an attribute or container path
(``self.history[3]``), a global, a closure cell. A storage shared by several tensors is counted
once, under the first name in that order; on CUDA sizes are rounded as the caching allocator
rounds them.

Usage::

    import devicekit as dk

    c = dk.memory.census(top=10)
    print(c)                        # two tables: by name, by device/dtype/shape
    c.by_name[0].name, c.by_name[0].bytes, c.total_bytes
"""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from devicekit.memory.paths import walk
from devicekit.memory.roots import frame_roots, user_frames
from devicekit.memory.tensors import scan_objects, storage_bytes, storage_key
from devicekit.units import format_size

__all__ = ["Census", "CensusEntry", "CensusGroup", "census"]


@dataclass(frozen=True)
class CensusEntry:
    """One named tensor. ``bytes`` is 0 when its storage was already counted under ``shared_with``."""

    name: str
    category: str  # parameter, buffer, gradient, optimizer state, local, global, closure, attribute, unnamed
    device: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    where: str = ""
    shared_with: str | None = None


@dataclass(frozen=True)
class CensusGroup:
    device: str
    dtype: str
    shape: tuple[int, ...]
    count: int
    bytes: int


@dataclass(frozen=True)
class Census:
    total_bytes: int
    tensor_count: int
    by_name: list[CensusEntry]
    by_group: list[CensusGroup]
    by_category: dict[str, int]
    by_device: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        lines = [f"{self.tensor_count} live tensors, {format_size(self.total_bytes)} (shared storage once)"]
        lines.append("by name:")
        for e in self.by_name:
            extra = f"  [{e.where}]" if e.where else ""
            lines.append(f"  {format_size(e.bytes):>10}  {e.name} ({e.category}, {e.dtype} {list(e.shape)} on {e.device}){extra}")
        lines.append("by device/dtype/shape:")
        for g in self.by_group:
            lines.append(f"  {format_size(g.bytes):>10}  {g.count} x {g.dtype} {list(g.shape)} on {g.device}")
        lines.extend(self.notes)
        return "\n".join(lines)

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.table import Table

        names = Table(title=f"tensors by name: {format_size(self.total_bytes)} in {self.tensor_count} tensors",
                      title_justify="left")
        for col in ("bytes", "name", "category", "dtype", "shape", "device", "where"):
            names.add_column(col, justify="right" if col == "bytes" else "left")
        for e in self.by_name:
            names.add_row(format_size(e.bytes), e.name, e.category, e.dtype, str(list(e.shape)), e.device, e.where)
        groups = Table(title="tensors by device, dtype and shape", title_justify="left")
        for col in ("bytes", "count", "dtype", "shape", "device"):
            groups.add_column(col, justify="right" if col in ("bytes", "count") else "left")
        for g in self.by_group:
            groups.add_row(format_size(g.bytes), str(g.count), g.dtype, str(list(g.shape)), g.device)
        return Group(names, groups)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def census(top: int = 20, *, device: str | None = None, frames: Iterable[types.FrameType] = (),
           tensors: list[torch.Tensor] | None = None) -> Census:
    """Take the census; ``top`` rows per table. ``device``: only tensors on this device
    (``"cuda:0"``) or device type (``"cuda"``). ``frames``: extra frames whose locals name
    tensors (the OOM explainer passes the traceback's frames)."""
    _check_arguments(top, device)
    if isinstance(device, torch.device):
        device = str(device)
    caller = sys._getframe(1)
    found, modules, optimizers = scan_objects()
    all_tensors = found if tensors is None else tensors
    del found
    if device is not None:
        all_tensors = [t for t in all_tensors if str(t.device) == device or t.device.type == device]
    names = _name_tensors(list(frames) + list(user_frames(caller)), modules, optimizers)
    del modules, optimizers
    entries: list[tuple[int, CensusEntry, torch.Tensor]] = []
    for tensor in all_tensors:
        name, category, where, rank = names.get(id(tensor), ("", "unnamed", "", 99))
        entries.append((rank, CensusEntry(name, category, str(tensor.device), _dtype(tensor),
                                          tuple(tensor.shape), storage_bytes(tensor), where), tensor))
    entries.sort(key=lambda item: (item[0], -item[1].bytes))
    owners: dict[tuple[str, int], str] = {}
    counted: list[tuple[CensusEntry, torch.Tensor]] = []
    groups: dict[tuple[str, str, tuple[int, ...]], list[int]] = {}
    by_category: dict[str, int] = {}
    by_device: dict[str, int] = {}
    for _, entry, tensor in entries:
        key = storage_key(tensor)
        if key is not None and key in owners:
            entry = CensusEntry(**{**asdict(entry), "bytes": 0, "shared_with": owners[key]})
        elif key is not None:
            owners[key] = entry.name
        counted.append((entry, tensor))
        group = groups.setdefault((entry.device, entry.dtype, entry.shape), [0, 0])
        group[0] += 1
        group[1] += entry.bytes
        by_category[entry.category] = by_category.get(entry.category, 0) + entry.bytes
        by_device[entry.device] = by_device.get(entry.device, 0) + entry.bytes
    del entries
    counted.sort(key=lambda pair: -pair[0].bytes)
    rows = [  # naming by referrers scans every object: only for the rows shown
        CensusEntry(**{**asdict(e), "name": _referrer_name(t)}) if not e.name else e
        for e, t in counted[:top]
    ]
    total = sum(e.bytes for e, _ in counted)
    count = len(counted)
    del counted
    group_rows = sorted((CensusGroup(d, dt, s, c, b) for (d, dt, s), (c, b) in groups.items()),
                        key=lambda g: -g.bytes)
    notes = ["tensors held only by C++ (saved for backward) are not Python objects and are not listed"]
    return Census(total, count, rows, group_rows[:top], by_category, by_device, notes)


def _check_arguments(top: Any, device: Any) -> None:
    """A bad ``top`` or ``device`` must not pass for "0 live tensors", which reads as a measurement."""
    from devicekit.errors import InvalidDeviceError, InvalidValueError

    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise InvalidValueError(f"census top={top!r} must be a whole number of rows >= 0, e.g. top=20")
    if device is None:
        return
    try:
        torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidDeviceError(
            f"census device={device!r} is not a device; write e.g. 'cuda', 'cuda:0' or 'cpu'"
        ) from None


_Name = tuple[str, str, str, int]  # name, category, where, rank (lower wins)


def _name_tensors(frames: list[types.FrameType], modules: list[torch.nn.Module],
                  optimizers: list[torch.optim.Optimizer]) -> dict[int, _Name]:
    """id(tensor) -> name, from modules and optimizers found by gc, then from frame roots."""
    names: dict[int, _Name] = {}
    variable_of: dict[int, str] = {}
    roots: list[tuple[str, str, Any, str]] = []  # name, origin, value, where
    seen_frames: set[int] = set()
    for frame in frames:
        if id(frame) in seen_frames:
            continue
        seen_frames.add(id(frame))
        where = f"{frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})"
        for root in frame_roots(frame, include_globals=True):
            value = root.get()
            roots.append((root.name, root.origin, value, where if root.origin == "local" else ""))
            variable_of.setdefault(id(value), root.name)
    main = sys.modules.get("__main__")
    for key, value in vars(main).items() if main is not None else ():
        if not key.startswith("__"):
            variable_of.setdefault(id(value), key)
            roots.append((key, "global", value, ""))
    children = {id(child) for m in modules for child in m.children()}
    param_names: dict[int, str] = {}
    for module in modules:
        if id(module) in children:
            continue
        root = variable_of.get(id(module), type(module).__name__.lower())
        for pname, param in module.named_parameters():
            full = f"{root}.{pname}"
            names.setdefault(id(param), (full, "parameter", "", 0))
            param_names.setdefault(id(param), full)
            if param.grad is not None:
                names.setdefault(id(param.grad), (f"{full}.grad", "gradient", "", 2))
        for bname, buf in module.named_buffers():
            names.setdefault(id(buf), (f"{root}.{bname}", "buffer", "", 1))
    for opt in optimizers:
        oname = variable_of.get(id(opt), "optimizer")
        for index, (param, state) in enumerate(opt.state.items()):
            pname = param_names.get(id(param), f"param{index}")
            for key, value in state.items() if isinstance(state, dict) else ():
                if isinstance(value, torch.Tensor):
                    names.setdefault(id(value), (f"{oname}.state[{pname}].{key}", "optimizer state", "", 3))
    walked: set[int] = set()
    for name, origin, value, where in roots:
        if id(value) in walked:  # the same module globals seen from several frames
            continue
        walked.add(id(value))
        for found in walk(name, value, max_depth=3, list_items=True, max_items=1000):
            if isinstance(found.value, torch.Tensor):
                category = "attribute" if found.steps else origin
                names.setdefault(id(found.value), (found.path, category, where, 4))
    return names


def _referrer_name(tensor: torch.Tensor) -> str:
    """Best effort for a tensor no root names: describe what refers to it."""
    for ref in gc.get_referrers(tensor):
        if isinstance(ref, types.CellType):
            for fn in gc.get_referrers(ref):
                if isinstance(fn, tuple):
                    for owner in gc.get_referrers(fn):
                        if isinstance(owner, types.FunctionType):
                            return f"closure cell of {owner.__qualname__}"
            return "closure cell"
        if isinstance(ref, list):
            return f"item of a list of {len(ref)}"
        if isinstance(ref, dict):
            key = next((k for k, v in ref.items() if v is tensor), None)
            owner = next((o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref), None)
            if owner is not None:
                return f"{type(owner).__name__}.{key}"
            return f"dict[{key!r}]"
        if isinstance(ref, tuple):
            return f"item of a tuple of {len(ref)}"
    return f"unnamed {_dtype(tensor)} tensor"
