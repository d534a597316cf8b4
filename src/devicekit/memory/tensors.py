"""Live tensors: find them with a garbage-collector walk and size them honestly.

Shared storage (views, ``x.view(...)``, ``x[0]``) is counted once, keyed by the storage's data
pointer; on CUDA a storage occupies what the caching allocator hands out (blocks rounded up to
512 bytes), so that is what is counted there.

Usage::

    from devicekit.memory.tensors import live_tensors, storage_bytes, total_bytes

    tensors = live_tensors()                 # every torch.Tensor a Python object refers to
    print(total_bytes(tensors))              # shared storage once
    print(storage_bytes(tensors[0]))
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor  # imported by torch itself: free

__all__ = ["CUDA_BLOCK", "live_tensors", "scan_objects", "storage_key", "storage_bytes", "total_bytes", "round_block"]

#: the CUDA caching allocator rounds every block up to a multiple of 512 bytes
CUDA_BLOCK = 512


def round_block(num_bytes: int, block: int = CUDA_BLOCK) -> int:
    """``num_bytes`` rounded up to the allocator's block size (``0`` stays ``0``)."""
    return -(-num_bytes // block) * block


def scan_objects() -> tuple[list[torch.Tensor], list[torch.nn.Module], list[torch.optim.Optimizer]]:
    """One pass over the garbage collector's objects: tensors, modules, optimizers."""
    kinds: dict[type, int] = {}
    found: tuple[list[Any], list[Any], list[Any]] = ([], [], [])
    tensor, module, optimizer = torch.Tensor, torch.nn.Module, torch.optim.Optimizer
    for obj in gc.get_objects():
        cls = type(obj)
        kind = kinds.get(cls)
        if kind is None:
            kind = kinds[cls] = (0 if issubclass(cls, tensor) else 1 if issubclass(cls, module)
                                 else 2 if issubclass(cls, optimizer) else 3)
        if kind < 3:
            found[kind].append(obj)
    return found


def live_tensors() -> list[torch.Tensor]:
    """Every tensor object alive in this process that the garbage collector can see.

    Tensors held only inside C++ (saved for backward, captured by a CUDA graph) are not Python
    objects and are not listed; :func:`devicekit.memory.usage` counts them through the allocator.
    """
    # type(obj), not isinstance: isinstance reads obj.__class__, which proxies and deprecated
    # module attributes intercept (warnings, dead weakproxies)
    return scan_objects()[0]


def _holds_no_memory(tensor: torch.Tensor) -> bool:
    """A meta or fake tensor (the estimate's, alive in a traceback it left) has no storage: a
    fake one says it is on the CPU with the bytes of its shape (PiB for an absurd sample)."""
    return tensor.is_meta or isinstance(tensor, FakeTensor)


def storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    """``(device, data pointer)`` of the storage behind ``tensor``; None if it has none."""
    if _holds_no_memory(tensor) or tensor.layout != torch.strided:
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses, functional tensors
        return None
    ptr = storage.data_ptr()
    if ptr == 0:
        return None
    return (str(tensor.device), ptr)


def storage_bytes(tensor: torch.Tensor, *, rounded: bool = True) -> int:
    """Bytes of the storage behind ``tensor`` (block-rounded on CUDA when ``rounded``)."""
    if _holds_no_memory(tensor):
        return 0
    if tensor.layout != torch.strided:  # sparse: values + indices
        nbytes = _sparse_bytes(tensor)
    else:
        try:
            nbytes = tensor.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            nbytes = tensor.numel() * tensor.element_size()
    if rounded and tensor.is_cuda and nbytes:
        return round_block(nbytes)
    return nbytes


def _sparse_bytes(tensor: torch.Tensor) -> int:
    parts: list[Any] = []
    try:
        if tensor.layout == torch.sparse_coo:
            parts = [tensor._values(), tensor._indices()]
        elif tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
            parts = [tensor.values(), tensor.crow_indices(), tensor.col_indices()]
        elif tensor.layout in (torch.sparse_csc, torch.sparse_bsc):
            parts = [tensor.values(), tensor.ccol_indices(), tensor.row_indices()]
    except RuntimeError:
        return 0
    return sum(p.numel() * p.element_size() for p in parts)


def total_bytes(tensors: Iterable[torch.Tensor], *, rounded: bool = True) -> int:
    """Bytes behind ``tensors`` with every storage counted once."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for tensor in tensors:
        key = storage_key(tensor)
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        total += storage_bytes(tensor, rounded=rounded)
    return total
