"""Bounded field types, and the one decoder, for documents another local user can write.

Lease records, queue tickets, the queue policy, the bench and batch-size caches and a job's
rank files lie in directories other users (or a job's other ranks) can write. Each has one
typed schema (a ``msgspec.Struct`` built from the field types here), decoded by
:func:`decode` at the one place its bytes become objects: every number finite and in a stated
range, pids and counts bounded whole numbers, GPU UUIDs and job ids in their format, strings
and lists of bounded length, the whole document of bounded size. A document that fails is
:class:`BadDocument` with a one-line reason; its reader ignores it and says so (with the file's
owner), never crashes or freezes. msgspec validates while it parses, in C, in time linear in
the bytes, so no hand-written pre-scan is needed.

Usage::

    import msgspec
    from devicekit.hardware.document_fields import BadDocument, Pid, decode

    class Doc(msgspec.Struct):
        pid: Pid

    decode(b'{"pid": 812}', Doc, limit=4096).pid          # 812
    decode(b'{"pid": 1e999}', Doc, limit=4096)            # BadDocument: pid: Number out of range
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import msgspec

__all__ = ["BadDocument", "IgnoredFile", "decode", "convert", "cut", "GpuUuid", "JobId", "Pid",
           "Count", "ByteCount", "EpochSeconds", "Seconds", "Percent", "Text", "Name",
           "PID_MAX", "MAX_COUNT", "JOB_PATTERN", "UUID_PATTERN"]

T = TypeVar("T")

#: the kernel's largest pid (``PID_MAX_LIMIT``, 2**22 on 64-bit Linux)
PID_MAX = 2**22
#: GPUs one request may ask for or list
MAX_COUNT = 4096
#: a job id: ``devicekit run --name``'s name, a generated hex token or a Slurm job id
#: (``812``, ``812_3`` for an array task): 1-64 letters, digits and ``._:@+=-``
JOB_PATTERN = r"\A[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,63}\Z"
#: a device UUID as NVML gives it (``GPU-5d9b...``, ``MIG-...``, old ``MIG-GPU-.../1/0``) or a
#: simulation names it: letters, digits and ``_.:/-``, at most 96 characters
UUID_PATTERN = r"\A[A-Za-z0-9][A-Za-z0-9_.:/-]{0,95}\Z"

GpuUuid = Annotated[str, msgspec.Meta(pattern=UUID_PATTERN)]
JobId = Annotated[str, msgspec.Meta(pattern=JOB_PATTERN)]
Pid = Annotated[int, msgspec.Meta(ge=1, le=PID_MAX)]
Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
#: a memory size: up to 4 EiB (2**62 bytes)
ByteCount = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
#: a wall-clock time, seconds since the epoch, before 2106 (display only: times that drive
#: behaviour come from file change times, which the writer cannot set)
EpochSeconds = Annotated[float, msgspec.Meta(ge=0, le=2**32)]
#: a duration: up to ten years
Seconds = Annotated[float, msgspec.Meta(ge=0, le=10 * 366 * 86400)]
Percent = Annotated[float, msgspec.Meta(ge=0, le=100)]
#: a line of text (a command, filters in words): bounded by its document's size (at most
#: 64 Ki characters), cut to what is kept by the reader (:func:`cut`: 200 characters for a
#: command), made inert by whoever prints it
Text = Annotated[str, msgspec.Meta(max_length=64 * 1024)]
#: a short name (a GPU model, a version, a key): at most 256 characters
Name = Annotated[str, msgspec.Meta(max_length=256)]


class BadDocument(ValueError):
    """A document that its schema refuses; ``str()`` is the one-line reason."""


@dataclass(frozen=True)
class IgnoredFile:
    """A file a reader did not trust, whose it is and why (``devicekit status`` and
    ``devicekit queue`` show them)."""

    name: str
    user: str
    why: str


def _reason(exc: BaseException) -> str:
    from devicekit.hardware.printable import printable

    if isinstance(exc, RecursionError):
        return "nested too deep"
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return cut(printable(text), 200)


def decode(data: bytes, kind: type[T], *, limit: int) -> T:
    """``data`` (JSON) as ``kind``, or :class:`BadDocument` saying why: larger than ``limit``
    bytes, not JSON, nested too deep, or a field out of its bounds."""
    if len(data) > limit:
        raise BadDocument(f"larger than {limit} bytes")
    try:
        return msgspec.json.decode(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError,
            UnicodeError) as exc:
        raise BadDocument(_reason(exc)) from None


def convert(data: Any, kind: type[T]) -> T:
    """Already-parsed data (e.g. TOML) as ``kind``, or :class:`BadDocument` saying why."""
    try:
        return msgspec.convert(data, type=kind, strict=True)
    except (msgspec.ValidationError, RecursionError, UnicodeError) as exc:
        raise BadDocument(_reason(exc)) from None


def cut(text: str, limit: int) -> str:
    """``text`` at most ``limit`` characters: longer text ends in ``...`` (the marker)."""
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."
