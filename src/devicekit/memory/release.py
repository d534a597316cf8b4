"""Free memory now and say how much went back: :func:`release` and :func:`empty_cache`.

``release(*objs)`` frees the storage of every tensor in ``objs`` (tensors, containers of them,
modules, optimizers) at once, even while other names still refer to the objects: the tensors
are left empty (zero-size storage), modules keep their structure without weights, optimizers
forget their state. Use it on things you are done with. ``empty_cache()`` then collects garbage
and hands cached blocks back to the driver (CUDA) or trims the C heap (CPU, glibc), and reports
what actually went back, measured before and after.

Usage::

    import devicekit as dk

    freed = dk.release(model, optimizer, activations)   # Released(...)
    print(freed)                 # "freed 1.2 GiB of tensors; 1.1 GiB returned to the driver"
    print(dk.empty_cache())
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from devicekit.memory.tensors import storage_bytes, storage_key
from devicekit.units import format_size

__all__ = ["Released", "release", "empty_cache"]


@dataclass(frozen=True)
class Released:
    """What :func:`release` / :func:`empty_cache` did, measured."""

    #: bytes of tensor storage freed by ``release`` (0 for ``empty_cache`` alone)
    tensors_freed: int
    #: bytes handed back to the CUDA driver, per device (``{"cuda:0": n}``); empty without CUDA
    returned_to_driver: dict[str, int]
    #: change of this process's resident memory (bytes; positive = shrank); None if unknown
    rss_returned: int | None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __str__(self) -> str:
        parts = []
        if self.tensors_freed:
            parts.append(f"freed {format_size(self.tensors_freed)} of tensors")
        for dev, n in self.returned_to_driver.items():
            parts.append(f"{format_size(n)} returned to the driver on {dev}")
        if self.rss_returned is not None:
            verb = "shrank" if self.rss_returned >= 0 else "grew"
            parts.append(f"process RSS {verb} by {format_size(abs(self.rss_returned))}")
        parts.extend(self.notes)
        return "; ".join(parts) if parts else "nothing to free"


def _rss() -> int | None:
    try:
        import psutil

        return int(psutil.Process(os.getpid()).memory_info().rss)
    except Exception:
        return None


def _malloc_trim() -> bool:
    """Ask glibc to give free heap pages back to the OS; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True


def empty_cache() -> Released:
    """Collect garbage, return cached CUDA blocks to the driver, trim the CPU heap; measure it."""
    rss_before = _rss()
    reserved_before = _reserved()
    gc.collect()
    notes: list[str] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    elif not torch.cuda.is_available():
        notes.append("no CUDA: nothing cached to return to a driver")
    if not _malloc_trim():
        notes.append("CPU heap not trimmed (no glibc); freed CPU memory stays in this process")
    returned = {dev: before - _reserved().get(dev, 0) for dev, before in reserved_before.items()}
    rss_after = _rss()
    rss = None if rss_before is None or rss_after is None else rss_before - rss_after
    return Released(0, {d: n for d, n in returned.items()}, rss, tuple(notes))


def _reserved() -> dict[str, int]:
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {f"cuda:{i}": torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count())}


def release(*objs: Any) -> Released:
    """Free the tensor storage of ``objs`` now, then :func:`empty_cache`; return what went back.

    Accepts tensors, ``nn.Module`` (parameters, buffers, gradients), ``torch.optim.Optimizer``
    (its state), and lists/tuples/dicts/sets of these. The objects stay usable as containers but
    their tensors are emptied: reading them afterwards raises. Parameter storage reached only
    through a view is freed too, because a view shares it.
    """
    rss_before = _rss()
    tensors: list[torch.Tensor] = []
    for obj in objs:
        _collect(obj, tensors, depth=0)
    seen: set[tuple[str, int]] = set()
    freed = 0
    for tensor in tensors:
        key = storage_key(tensor)
        if key is None or key in seen:
            continue
        seen.add(key)
        freed += storage_bytes(tensor)
        with torch.no_grad():
            tensor.untyped_storage().resize_(0)
    del tensors
    after = empty_cache()
    rss_after = _rss()
    rss = None if rss_before is None or rss_after is None else rss_before - rss_after
    return Released(freed, after.returned_to_driver, rss, after.notes)


def _collect(obj: Any, out: list[torch.Tensor], depth: int) -> None:
    if depth > 6:
        return
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        if (obj.is_leaf or obj.retains_grad) and obj.grad is not None:  # non-leaf .grad warns
            out.append(obj.grad)
            obj.grad = None
        return
    if isinstance(obj, torch.nn.Module):
        for param in obj.parameters():
            _collect(param, out, depth + 1)
        out.extend(obj.buffers())
        return
    if isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            _collect(state, out, depth + 1)
        obj.state.clear()
        return
    if isinstance(obj, dict):
        for value in obj.values():
            _collect(value, out, depth + 1)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            _collect(value, out, depth + 1)
        return
    from devicekit.errors import InvalidValueError

    raise InvalidValueError(
        f"release() cannot free a {type(obj).__name__}; pass tensors, modules, optimizers or containers of them"
    )
