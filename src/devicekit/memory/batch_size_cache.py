"""The batch-size cache: one JSON file of ``{key: {"batch_size": n, ...}}``, written atomically.

The file may be shared (``cache=``): it is read bounded (16 MiB, never blocking) and each entry
decoded by :class:`CachedBatchSize` (a whole number from 1 to 2**31, names of at most 256
characters); an entry that fails is no answer, so the search runs again.

Usage::

    from devicekit.memory.batch_size_cache import read_cached, write_cached

    write_cached("resnet50-224", 181)          # default file under $XDG_CACHE_HOME/devicekit
    read_cached("resnet50-224")                # 181
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import msgspec

from devicekit.errors import InvalidValueError
from devicekit.hardware.document_fields import BadDocument, Name, convert

__all__ = ["default_cache_file", "read_cached", "write_cached"]


class CachedBatchSize(msgspec.Struct):
    """One entry of the cache: a batch size found on ``device`` (None: on the CPU)."""

    batch_size: Annotated[int, msgspec.Meta(ge=1, le=2**31)]
    device: Name | None = None
    time: Name = ""
    torch: Name = ""


def default_cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "devicekit" / "batch_size.json"


def _load(path: Path) -> dict[str, Any]:
    from devicekit.hardware.bounded_read import BadFile, read_json

    try:  # bounded, never blocking: a FIFO or /dev/zero put there is refused, not read
        data = read_json(path, 16 * 1024 * 1024)
    except BadFile as exc:
        if exc.missing:
            return {}
        raise InvalidValueError(f"batch-size cache {exc}; delete it or pass another cache=") from None
    if not isinstance(data, dict):
        raise InvalidValueError(f"batch-size cache {str(path)!r} is not a JSON object; delete it or pass another cache=")
    return data


def _device_name() -> str | None:
    """The GPU an answer was found on (None without CUDA): an answer is only valid there."""
    try:
        import torch

        if torch.cuda.is_available():
            return str(torch.cuda.get_device_name(torch.cuda.current_device()))
    except Exception:
        pass
    return None


def read_cached(key: str, cache: str | Path | None = None) -> int | None:
    """The answer cached under ``key``, or None; an answer found on another GPU model (or on
    the CPU for a GPU now, or the reverse) does not count: it would not fit, or would waste memory."""
    raw = _load(Path(cache) if cache is not None else default_cache_file()).get(key)
    if raw is None:
        return None
    try:  # one entry's schema: a foreign or broken entry is no answer, never an error
        entry = convert(raw, CachedBatchSize)
    except BadDocument:
        return None
    if entry.device != _device_name():
        return None
    return entry.batch_size


def write_cached(key: str, batch_size: int, cache: str | Path | None = None) -> Path:
    """Record ``batch_size`` under ``key``; the file is replaced atomically (never half-written)."""
    path = Path(cache) if cache is not None else default_cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _load(path)
    entry: dict[str, Any] = {"batch_size": batch_size, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        import torch

        entry["torch"] = torch.__version__
    except Exception:  # the cache entry is still useful without it
        pass
    device = _device_name()
    if device is not None:
        entry["device"] = device
    data[key] = entry
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
