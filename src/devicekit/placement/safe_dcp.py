"""Reading ``torch.distributed.checkpoint`` directories without running code from them.

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain :mod:`pickle`, opens data files
wherever the metadata names them (following links, blocking on a FIFO), and its default load
planner reads non-tensor items with ``torch.load(..., weights_only=False)``: a checkpoint
directory another user can write could run any code, hang or read your files on load.
:class:`SafeReader` reads ``.metadata`` through an allow-list unpickler
(:mod:`devicekit.placement.dcp_metadata`), checks every storage entry against the metadata
(:func:`check_storage`: plain names inside the directory, no stream transforms, no overlaps,
each tensor item about the size of its chunk, each other item at most
:data:`MAX_BYTES_ITEM`), and opens data files only as regular files inside the directory, never
through a link, and only when long enough (:mod:`devicekit.placement.dcp_files`).
:class:`SafeLoadPlanner` and :class:`SafeEmptyLoadPlanner` read non-tensor items with
``weights_only=True``. Each refusal is one line naming the file and what was wrong.

Usage::

    import torch.distributed.checkpoint as dcp
    from devicekit.placement.safe_dcp import SafeLoadPlanner, SafeReader

    dcp.load(state, storage_reader=SafeReader("ckpt/step-100"), planner=SafeLoadPlanner())
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from devicekit.errors import CheckpointError, UnsafeCheckpointError
from devicekit.placement.dcp_files import CheckedFileSystem, check_regular, read_bounded
from devicekit.placement.dcp_metadata import MAX_METADATA_BYTES, read_metadata

__all__ = ["SafeReader", "SafeLoadPlanner", "SafeEmptyLoadPlanner", "read_metadata",
           "read_bounded", "check_storage", "MAX_METADATA_BYTES", "MAX_BYTES_ITEM"]

#: the largest non-tensor item read (optimizer settings, a step, a small list: far below)
MAX_BYTES_ITEM = 1024 * 1024 * 1024
#: what torch.save adds around a tensor's bytes (zip headers, the pickle): a few KiB in fact
_TENSOR_SLACK = 1024 * 1024


def _dims(value: Any, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
            type(d) is int and d >= 0 for d in value):  # bool is no dimension
        raise CheckpointError(f"sharded checkpoint {where!r} gives {what} {value!r}, not "
                              "sizes; the metadata is corrupt")
    return tuple(value)


def _tensor_sizes(fqn: str, md: Any, where: str) -> tuple[int, dict[tuple[int, ...], int]]:
    """(bytes of the whole tensor, {chunk offsets: bytes of the chunk}), chunks inside it."""
    properties = getattr(md, "properties", None)
    dtype = getattr(properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"sharded checkpoint {where!r} gives item {fqn!r} the dtype "
                              f"{dtype!r}; the metadata is corrupt")
    size = _dims(md.size, f"the size of {fqn!r} as", where)
    chunks: dict[tuple[int, ...], int] = {}
    for chunk in md.chunks if isinstance(md.chunks, list) else ():
        offsets = _dims(chunk.offsets, f"a chunk offset of {fqn!r} as", where)
        sizes = _dims(chunk.sizes, f"a chunk size of {fqn!r} as", where)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
            raise CheckpointError(f"sharded checkpoint {where!r} has a chunk of {fqn!r} at "
                                  f"{offsets} of {sizes}, outside its size {size}; the metadata "
                                  "is corrupt")
        chunks[offsets] = math.prod(sizes) * dtype.itemsize
    return math.prod(size) * dtype.itemsize, chunks


def check_storage(metadata: Any, directory: Path) -> dict[str, int]:
    """Refuse storage entries that read outside ``directory`` or more than the metadata says.

    Returns the bytes each data file must hold. A tensor's bytes must be stored by its chunks'
    entries, so a tensor this loader allocates is never larger than the data files on disk.
    """
    where = str(directory)
    state, storage = metadata.state_dict_metadata, metadata.storage_data
    if not isinstance(state, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"sharded checkpoint {where!r} has metadata without its item or "
                              "storage tables; the metadata is corrupt")
    tensors: dict[str, tuple[int, dict[tuple[int, ...], int]]] = {}
    for fqn, md in state.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[fqn] = _tensor_sizes(fqn, md, where)
        elif not isinstance(md, BytesStorageMetadata):
            raise CheckpointError(f"sharded checkpoint {where!r} describes item {fqn!r} as "
                                  f"{type(md).__name__}; the metadata is corrupt")
    regions: dict[str, list[tuple[int, int, str]]] = {}
    stored: dict[str, int] = {}
    for index, info in storage.items():
        fqn = getattr(index, "fqn", None)
        relative = getattr(info, "relative_path", None)
        if (not isinstance(relative, str) or relative in ("", ".", "..")
                or any(c in relative for c in "/\\\0")):
            raise UnsafeCheckpointError(
                f"sharded checkpoint {where!r} names data file {relative!r} outside its "
                "directory; refused (the metadata may be malicious)")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise CheckpointError(f"sharded checkpoint {where!r} stores item {fqn!r} at offset "
                                  f"{offset!r}, length {length!r}; the metadata is corrupt")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"sharded checkpoint {where!r} stores item {fqn!r} through stream transforms "
                f"{list(info.transform_descriptors)!r} (compression), whose output devicekit "
                "cannot bound; refused: save it without extensions")
        if fqn in tensors:
            limit = tensors[fqn][1].get(tuple(getattr(index, "offset", None) or ()))
            if limit is None:
                continue  # no chunk of the metadata: never read
            stored[fqn] = stored.get(fqn, 0) + length
            limit += _TENSOR_SLACK
        elif isinstance(state.get(fqn), BytesStorageMetadata):
            limit = MAX_BYTES_ITEM
        else:
            continue  # an entry for no item of the metadata: never read
        if length > limit:
            raise UnsafeCheckpointError(
                f"sharded checkpoint {where!r} stores item {fqn!r} in {length} bytes of "
                f"{relative!r}, more than its metadata allows ({limit}); refused (the metadata "
                "may be malicious)")
        regions.setdefault(relative, []).append((offset, offset + length, str(fqn)))
    for fqn, (nbytes, _) in tensors.items():
        if nbytes > stored.get(fqn, 0):
            raise CheckpointError(
                f"sharded checkpoint {where!r} describes {fqn!r} as {nbytes} bytes but stores "
                f"only {stored.get(fqn, 0)} of them; the metadata is corrupt")
    needed: dict[str, int] = {}
    for relative, spans in regions.items():
        spans.sort()
        for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise UnsafeCheckpointError(
                    f"sharded checkpoint {where!r} stores {first!r} and {second!r} in the same "
                    f"bytes of {relative!r}; refused (the metadata may be malicious)")
        needed[relative] = spans[-1][1]
        check_regular(directory / relative, "sharded checkpoint data file", needed[relative])
    return needed


class SafeReader(FileSystemReader):
    """``FileSystemReader`` that reads only what the checked metadata allows (module doc).

    ``metadata``: the directory's ``.metadata`` already read by :func:`read_metadata`, so a
    large one is not unpickled twice.
    """

    def __init__(self, path: str | os.PathLike[str], *args: Any, metadata: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = CheckedFileSystem(self.path)
        self._metadata = metadata

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(checkpoint_id)
        self.fs = CheckedFileSystem(self.path)
        if checkpoint_id:
            self._metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{int(rank)}.metadata"
        metadata = self._metadata if rank is None and self._metadata is not None else \
            read_metadata(Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        needed = check_storage(metadata, Path(self.path))
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.fs.needed = needed


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
