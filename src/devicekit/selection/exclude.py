"""``exclude=``: which GPUs and MIG instances a selection must leave alone.

Entries are NVML indices, full or prefix UUIDs, or 8-digit short UUIDs; an index or the UUID of
a GPU in MIG mode covers every MIG instance of it, a ``MIG-`` UUID one instance. An entry that
names nothing (a typo) is an error, never ignored.

Usage::

    from devicekit.selection.exclude import excluded, parse_exclude

    uuids = excluded(devices, parse_exclude("0,GPU-5d9b"))
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from devicekit.errors import InvalidValueError
from devicekit.hardware.gpu import GPU

__all__ = ["parse_exclude", "excluded"]


def parse_exclude(exclude: Any) -> tuple[str, ...]:
    items: Iterable[Any] = [exclude] if isinstance(exclude, (str, int)) else exclude
    out = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, str)) or str(item).strip() == "":
            raise InvalidValueError(f"exclude entry {item!r} is not a GPU index or UUID")
        if isinstance(item, int) and item < 0:
            raise InvalidValueError(f"exclude entry {item!r} is not a GPU index (indices start at 0)")
        out.extend(part.strip() for part in str(item).split(",") if part.strip())
    return tuple(out)


def excluded(devices: Sequence[GPU], exclude: tuple[str, ...], *,
             what: str = "exclude entry") -> set[str]:
    """UUIDs of the devices ``exclude`` names; an entry naming no GPU is an error (a typo),
    saying ``what`` the entry was (``"GPU"`` where the caller names GPUs to use).

    An index or a GPU UUID in MIG mode names every MIG instance of that GPU; a ``MIG-`` UUID
    names one instance.
    """
    chosen: set[str] = set()
    for entry in exclude:
        if entry.isdigit():
            found = [d for d in devices if d.index == int(entry)]  # MIG instances share it
        else:
            found = [d for d in devices if _names(entry, d.uuid)]
            if not found:
                found = [d for d in devices if d.parent_uuid and _names(entry, d.parent_uuid)]
        if len({d.parent_uuid or d.uuid for d in found}) != 1 or (
                len(found) > 1 and not entry.isdigit() and _names(entry, found[0].uuid)):
            why = "matches several GPUs" if found else "matches no GPU"
            raise InvalidValueError(
                f"{what} {entry!r} {why}; use an index or UUID from 'devicekit status'"
            )
        chosen.update(d.uuid for d in found)
    return chosen


def _names(entry: str, uuid: str) -> bool:
    """Whether ``entry`` is ``uuid``, a prefix of it, or its short form (8 hex digits)."""
    lowered, uuid = entry.lower(), uuid.lower()
    return uuid.startswith(lowered) or (uuid.startswith("gpu-") and uuid[4:12] == lowered)
