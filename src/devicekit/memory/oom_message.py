"""Out-of-memory errors: recognise them and read the figures out of their messages.

Recognised: ``torch.OutOfMemoryError`` (CUDA, also the other accelerators' OOM), ``MemoryError``,
and ``RuntimeError`` from the CPU allocator (``DefaultCPUAllocator: can't allocate memory`` /
``not enough memory``), cuBLAS/cuDNN allocation failures, and MPS/XPU out-of-memory text.
Figures from both CUDA message formats (torch >= 2.1 and the older one) are parsed to bytes.

Usage::

    from devicekit.memory.oom_message import is_oom, parse_oom

    try:
        ...
    except Exception as exc:
        if is_oom(exc):
            facts = parse_oom(str(exc))
            facts.requested, facts.free, facts.reserved_unused, facts.processes
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

__all__ = ["OOMFacts", "is_oom", "parse_oom"]

_OOM_TEXT = (
    "out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input",
)

_SIZE = r"([0-9]+(?:\.[0-9]+)?\s*(?:bytes|[KMGT]i?B|B))"
_UNITS = {"bytes": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def _bytes(text: str | None) -> int | None:
    if text is None:
        return None
    match = re.match(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)", text.strip())
    if not match:
        return None
    return int(float(match.group(1)) * _UNITS.get(match.group(2).lower(), 1))


@dataclass(frozen=True)
class OOMFacts:
    """What an OOM message says; ``None`` where it does not say."""

    backend: str  # "cuda", "cpu", "mps", "xpu" or "unknown"
    requested: int | None = None
    device: int | None = None
    total: int | None = None
    free: int | None = None
    allowed: int | None = None  # set_per_process_memory_fraction limit
    process_in_use: int | None = None
    allocated: int | None = None
    reserved_unused: int | None = None
    reserved: int | None = None
    #: other processes named in the message: (pid, bytes)
    processes: tuple[tuple[int, int], ...] = field(default_factory=tuple)


def is_oom(exc: BaseException | None) -> bool:
    """True for errors that mean "not enough memory" (and never for other errors)."""
    if exc is None:
        return False
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if (oom_type is not None and isinstance(exc, oom_type)) or isinstance(exc, MemoryError):
        return True
    if isinstance(exc, RuntimeError) and exc.args:
        text = str(exc.args[0])
        return any(marker in text for marker in _OOM_TEXT)
    return False


def _find(pattern: str, text: str) -> str | None:
    match = re.search(pattern, text, re.S)
    return match.group(1) if match else None


def parse_oom(message: str) -> OOMFacts:
    """Figures from an OOM message (CUDA new and old formats, CPU allocator, MPS)."""
    text = " ".join(message.split())
    if "DefaultCPUAllocator" in text or "alloc_cpu" in text:
        return OOMFacts("cpu", requested=_bytes(_find(r"tried to allocate ([0-9]+ bytes)", text)))
    if text.startswith("MPS") or "MPS backend out of memory" in text:
        return OOMFacts("mps", requested=_bytes(_find(r"Tried to allocate " + _SIZE, text)),
                        allocated=_bytes(_find(r"MPS allocated: " + _SIZE, text)),
                        allowed=_bytes(_find(r"max allowed: " + _SIZE, text)))
    backend = "xpu" if "XPU" in text else "cuda" if ("CUDA" in text or "GPU" in text) else "unknown"
    requested = _bytes(_find(r"Tried to allocate " + _SIZE, text))
    device_text = _find(r"GPU ?([0-9]+)", text)
    device = int(device_text) if device_text is not None else None
    if "total capacity of" in text:  # torch >= 2.1
        processes = tuple((int(pid), _bytes(size) or 0) for pid, size in
                          re.findall(r"Process ([0-9]+) has " + _SIZE + " memory in use", text))
        return OOMFacts(
            backend, requested=requested, device=device,
            total=_bytes(_find(r"total capacity of " + _SIZE, text)),
            free=_bytes(_find(r"of which " + _SIZE + " is free", text)),
            allowed=_bytes(_find(_SIZE + r" allowed;", text)),
            process_in_use=_bytes(_find(r"this process has " + _SIZE + " memory in use", text)),
            allocated=_bytes(_find(r"Of the allocated memory " + _SIZE + " is allocated by PyTorch", text)),
            reserved_unused=_bytes(_find(_SIZE + r" is reserved by PyTorch but unallocated", text)),
            processes=processes,
        )
    allocated = _bytes(_find(_SIZE + r" already allocated", text))  # torch < 2.1
    reserved = _bytes(_find(_SIZE + r" reserved in total by PyTorch", text))
    return OOMFacts(
        backend, requested=requested, device=device,
        total=_bytes(_find(_SIZE + r" total capacity", text)),
        free=_bytes(_find(_SIZE + r" free", text)), allocated=allocated, reserved=reserved,
        reserved_unused=reserved - allocated if reserved is not None and allocated is not None else None,
    )
