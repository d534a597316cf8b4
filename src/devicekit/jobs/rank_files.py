"""What the hang doctor reads of a rank's files, decoded once by one schema, bounded.

A job's ranks write ``rank<N>.json`` (their answer: stack, records, Flight Recorder status),
``rank<N>.progress`` and ``rank<N>.last`` into the job's private directory; a rank is the
user's own code, so these files may be anything: cut short, 1 MiB of ``[`` (a
``RecursionError`` for ``json``), numbers of ``1e999``. :func:`load_rank_file` reads at most
:data:`MAX_RANK_FILE` bytes and accepts a file only when :class:`RankFile` holds (every field the
report reads bounded: numbers finite, lists of bounded length, names and frames of bounded
text); any other file is treated as one the rank never wrote. Rank stacks (faulthandler text)
are read bounded by :func:`read_rank_text`.

Usage::

    from devicekit.jobs.rank_files import load_rank_file

    answer = load_rank_file("/tmp/devicekit-launch-x/hang/rank1.json")   # dict, or None
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from devicekit.hardware.document_fields import BadDocument, Name, Pid, Text, decode

__all__ = ["RankFile", "load_rank_file", "read_rank_text", "MAX_RANK_FILE"]

#: the most read of any file a rank wrote
MAX_RANK_FILE = 1 << 20
_Seq = Annotated[int, msgspec.Meta(ge=-1, le=2**62)]
_Line = Annotated[int, msgspec.Meta(ge=0, le=10**8)]
#: a collective's shapes: up to 256 tensors of up to 64 dimensions (or nested lists of them)
_Shapes = Annotated[list[Any], msgspec.Meta(max_length=256)]


class Collective(msgspec.Struct):
    """One recorded collective (``records`` of an answer, and ``rank<N>.last``)."""

    seq: _Seq | None = None
    op: Name | None = None
    group: Name | None = None
    shapes: _Shapes = []
    dtypes: Annotated[list[Name], msgspec.Meta(max_length=256)] = []
    where: Text | None = None
    state: Name | None = None
    time: Annotated[float, msgspec.Meta(ge=0, le=2**32)] | None = None


class RankFile(msgspec.Struct):
    """Any of a rank's JSON files: the answer, the progress mark, the last collective."""

    request: Annotated[str, msgspec.Meta(max_length=64)] | int | None = None
    rank: Annotated[int, msgspec.Meta(ge=0, le=2**20)] | None = None
    pid: Pid | None = None
    time: Annotated[float, msgspec.Meta(ge=0, le=2**32)] | None = None
    torch_seq: _Seq | None = None
    seq: _Seq | None = None
    op: Name | None = None
    state: Name | None = None
    clean: bool | None = None
    timeout: Annotated[float, msgspec.Meta(ge=0, le=1e15)] | None = None
    main_stack: Annotated[list[tuple[Text, _Line, Name]], msgspec.Meta(max_length=512)] = []
    records: Annotated[list[Collective], msgspec.Meta(max_length=100_000)] = []
    flight_recorder: dict[Annotated[str, msgspec.Meta(max_length=64)], Any] | None = None


def _read(path: str, limit: int = MAX_RANK_FILE) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(limit + 1)
    except OSError:
        return b""


def load_rank_file(path: str) -> dict[str, Any] | None:
    """The rank file at ``path`` as plain data, or None when absent, too large or not a
    :class:`RankFile`."""
    data = _read(path)
    if not data:
        return None
    try:
        decode(data, RankFile, limit=MAX_RANK_FILE)
    except BadDocument:
        return None
    found = msgspec.json.decode(data)  # the same bytes, already known to be a bounded object
    return found if isinstance(found, dict) else None


def read_rank_text(path: str, limit: int = MAX_RANK_FILE) -> str:
    """At most ``limit`` bytes of a rank's text file, decoded leniently ("" when unreadable)."""
    return _read(path, limit)[:limit].decode("utf-8", "replace")
