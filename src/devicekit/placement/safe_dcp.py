"""Reading ``torch.distributed.checkpoint`` directories without running code from them.

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain :mod:`pickle`, and its default
load planner reads non-tensor items with ``torch.load(..., weights_only=False)``: a checkpoint
directory another user can write could run any code on load. :class:`SafeReader` reads
``.metadata`` (a regular file, bounded in size) with an allow-list unpickler, as
``weights_only`` does for ``.pt`` files: only DCP's own dataclasses and enums, ``torch.Size``
and torch's dtypes/layouts/memory formats; any other global is refused with
:class:`~devicekit.errors.UnsafeCheckpointError` naming the file and the global, before it is
called. It also refuses data file paths that leave the directory. :class:`SafeLoadPlanner`
and :class:`SafeEmptyLoadPlanner` read non-tensor items with ``weights_only=True``.

Usage::

    import torch.distributed.checkpoint as dcp
    from devicekit.placement.safe_dcp import SafeLoadPlanner, SafeReader

    dcp.load(state, storage_reader=SafeReader("ckpt/step-100"), planner=SafeLoadPlanner())
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import re
import stat
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)

from devicekit.errors import CheckpointError, UnsafeCheckpointError

__all__ = ["SafeReader", "SafeLoadPlanner", "SafeEmptyLoadPlanner", "read_metadata",
           "MAX_METADATA_BYTES"]

#: the largest ``.metadata`` read (a checkpoint of 10,000 tensors on 1,024 ranks is far below)
MAX_METADATA_BYTES = 512 * 1024 * 1024
_DCP_PREFIX = "torch.distributed.checkpoint."
_PLAIN = {("collections", "OrderedDict"), ("torch", "Size"),
          ("torch.serialization", "_get_layout"),  # a name lookup: how torch.strided pickles
          ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}  # the checkpoint_id


class _AllowListUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the checkpoint's own data types."""

    def __init__(self, data: bytes, source: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN:
            return super().find_class(module, name)
        if module == "torch" and "." not in name:
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        if module.startswith(_DCP_PREFIX) and "." not in name:
            value = super().find_class(module, name)
            if isinstance(value, type) and (dataclasses.is_dataclass(value)
                                            or issubclass(value, enum.Enum)):
                return value
        raise UnsafeCheckpointError(
            f"sharded checkpoint metadata {str(self.source)!r} references {module}.{name}, which "
            "is not a checkpoint data type; refused without running it (the file may be malicious)")


def read_bounded(path: Path, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``); never blocks on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise CheckpointError(f"cannot read {what} {str(path)!r}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{what} {str(path)!r} is not a regular file; refused")
        if info.st_size > limit:
            raise CheckpointError(f"{what} {str(path)!r} is {info.st_size} bytes, over the "
                                  f"{limit} bytes devicekit reads; refused")
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise CheckpointError(f"{what} {str(path)!r} grew past {limit} bytes while read; refused")
    return data


def read_metadata(path: Path) -> Any:
    """The DCP ``Metadata`` in the file ``path``, unpickled through the allow-list."""
    data = read_bounded(path, MAX_METADATA_BYTES, "sharded checkpoint metadata")
    try:
        metadata = _AllowListUnpickler(data, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # truncated, corrupt, wrong arguments to an allowed type
        raise CheckpointError(f"cannot read sharded checkpoint metadata {str(path)!r}: "
                              f"{type(exc).__name__}: {str(exc)[:200]}; the file is corrupt") from None
    if type(metadata).__name__ != "Metadata" or not hasattr(metadata, "state_dict_metadata"):
        raise CheckpointError(f"sharded checkpoint metadata {str(path)!r} holds a "
                              f"{type(metadata).__name__}, not checkpoint metadata; the file is corrupt")
    return metadata


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read through the allow-list (see module doc)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        metadata = read_metadata(Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        for info in (metadata.storage_data or {}).values():
            relative = str(getattr(info, "relative_path", ""))
            if not relative or "/" in relative or "\\" in relative or relative in (".", ".."):
                raise UnsafeCheckpointError(
                    f"sharded checkpoint {str(self.path)!r} names data file {relative!r} outside "
                    "its directory; refused (the metadata may be malicious)")
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


def _load_bytes_safely(planner: DefaultLoadPlanner, read_item: Any, value: io.BytesIO) -> None:
    try:
        loaded = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"it references {refused.group(1)}" if refused else "it is not plain data"
        raise UnsafeCheckpointError(
            f"sharded checkpoint item {read_item.dest_index.fqn!r} holds Python objects that safe "
            f"loading refuses ({what}); refused without running them") from None
    if planner.flatten_state_dict:
        from torch.distributed.checkpoint._traverse import set_element

        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], loaded)
    else:
        planner.state_dict[read_item.dest_index.fqn] = loaded


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor items with ``weights_only=True``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        _load_bytes_safely(self, read_item, value)


class SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner):
    """The planner that rebuilds a whole state dict, reading non-tensor items safely."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        _load_bytes_safely(self, read_item, value)
