"""Bench results cached per GPU (by UUID), so selection and the capability score can use them.

One JSON file per device under ``$DEVICEKIT_BENCH_CACHE`` (default
``$XDG_CACHE_HOME/devicekit/bench``, i.e. ``~/.cache/devicekit/bench``), named by the GPU's
UUID (``cpu.json`` for the host), written atomically (a temporary file renamed over the old
one), so a reader never sees half a file. A corrupt or foreign file, or one that fails
:class:`BenchDocument` (a speed that is not a finite number from 0 to 100,000 TFLOP/s, a name
over 256 characters), reads as "no result" (the score falls back to the known-model table),
never as an error in ``status``/``select``.

Usage::

    from devicekit.hardware.bench_cache import read_result, write_result

    write_result("GPU-5d9b...", {"name": "NVIDIA H100 80GB HBM3", "matmul_tflops": {"bf16": 702.1}})
    read_result("GPU-5d9b...")["matmul_tflops"]["bf16"]        # 702.1
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Annotated, Any

import msgspec

from devicekit.hardware.document_fields import BadDocument, Name, convert

__all__ = ["CACHE_ENV", "BenchDocument", "cache_dir", "read_result", "write_result"]

CACHE_ENV = "DEVICEKIT_BENCH_CACHE"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


#: a dtype name (``bf16``) and a speed in TFLOP/s (0 to 100,000: far above any GPU's)
_Tflops = dict[Annotated[str, msgspec.Meta(max_length=16)], Annotated[float, msgspec.Meta(ge=0, le=1e5)]]


class BenchDocument(msgspec.Struct):
    """What selection and the capability score read of a cached result (other keys are kept
    but never read by them)."""

    name: Name = ""
    matmul_tflops: Annotated[_Tflops, msgspec.Meta(max_length=32)] = {}


def cache_dir() -> Path:
    """Where bench results live (``$DEVICEKIT_BENCH_CACHE`` or the XDG cache)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "devicekit" / "bench"


def _file(key: str) -> Path:
    return cache_dir() / f"{_SAFE.sub('_', key)}.json"


def read_result(key: str) -> dict[str, Any] | None:
    """The cached result for a GPU UUID (or ``"cpu"``); None when absent or unreadable."""
    from devicekit.hardware.bounded_read import BadFile, read_json

    try:  # bounded, never blocking: the cache directory may be shared
        data = read_json(_file(key), 1024 * 1024)
        convert(data, BenchDocument)  # what selection reads of it, bounded
    except (BadFile, BadDocument):
        return None
    return data if isinstance(data, dict) else None


def write_result(key: str, result: dict[str, Any]) -> Path:
    """Store ``result`` for ``key`` atomically; returns the file written."""
    path = _file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(result, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
