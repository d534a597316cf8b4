"""The size ceiling of a status document: lists another user can grow are cut, the rest counted.

``devicekit status --json``, ``devicekit serve``'s ``/api/status`` and ``/metrics`` are built from
one status document, and other users decide how many leases, tickets and junk files it sees.
Each item is bounded by its schema (a lease: a UUID of at most 96 characters, a host of 255, a
command of 200, a job id of 64: about 1 KiB of text, at most 4 KiB as escaped JSON); each list
here is cut to a stated length with the count of the rest beside it (``leases_not_listed``,
``other_leases_not_listed``, ``queue_not_listed``, ``ignored_leases_not_listed``), so the
document is at most :data:`MAX_LEASES_LISTED` leases per GPU (and as many again per MIG
instance, and on devices not present), :data:`MAX_QUEUE_LISTED` waiting jobs and
:data:`MAX_WARNINGS` warnings of :data:`MAX_WARNING_CHARS` characters, whatever the lease
directory holds: about 128 KiB per GPU and per MIG instance at the very most.

Usage::

    from devicekit.sharing.status_ceiling import listed

    entry = {}
    listed(entry, "leases", leases)      # entry["leases"]: the first 32; entry["leases_not_listed"]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from devicekit.hardware.document_fields import IgnoredFile, cut

__all__ = ["MAX_LEASES_LISTED", "MAX_QUEUE_LISTED", "MAX_IGNORED_LISTED", "MAX_WARNINGS",
           "MAX_WARNING_CHARS", "listed", "ceiling_warnings", "ignored_warnings"]

#: leases listed per device (GPU or MIG instance), and leases on devices not present
MAX_LEASES_LISTED = 32
#: waiting jobs listed
MAX_QUEUE_LISTED = 128
#: ignored lease files listed (each with its owner and why)
MAX_IGNORED_LISTED = 16
#: warning lines kept, and the characters of each
MAX_WARNINGS = 64
MAX_WARNING_CHARS = 400
#: ignored lease files named one by one in the warnings (the rest: one line with the count)
_IGNORED_NAMED = 4


def listed(doc: dict[str, Any], key: str, items: Sequence[Any], *,
           limit: int = MAX_LEASES_LISTED) -> None:
    """Set ``doc[key]`` to the first ``limit`` of ``items`` and ``doc[key + "_not_listed"]`` to
    how many were left out."""
    doc[key] = list(items[:limit])
    doc[f"{key}_not_listed"] = max(len(items) - limit, 0)


def ceiling_warnings(warnings: Iterable[str]) -> list[str]:
    """At most :data:`MAX_WARNINGS` lines of at most :data:`MAX_WARNING_CHARS` characters;
    the last says how many more there were."""
    lines = [cut(str(w), MAX_WARNING_CHARS) for w in warnings]
    if len(lines) <= MAX_WARNINGS:
        return lines
    rest = len(lines) - (MAX_WARNINGS - 1)
    return [*lines[: MAX_WARNINGS - 1], f"... and {rest} more warnings"]


def ignored_warnings(ignored: Sequence[IgnoredFile]) -> list[str]:
    """One warning per ignored lease file (the first few), then one with the count of the rest."""
    lines = [f"lease file {i.name} of {i.user} ignored: {i.why}" for i in ignored[:_IGNORED_NAMED]]
    if len(ignored) > _IGNORED_NAMED:
        lines.append(f"lease files ignored: {len(ignored) - _IGNORED_NAMED} more (see "
                     "ignored_leases in status --json)")
    return lines
