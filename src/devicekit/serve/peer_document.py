"""A peer's status document, checked and rebuilt before anything shows or judges it.

What another machine's ``devicekit serve`` sends is untrusted. :func:`clean_status` accepts only
a ``status --json`` document of schema 1 and returns a *new* document holding just the fields
the lab view uses, each of the type docs/cli.md gives: text cut to a bound (it is made inert
where it is printed), numbers finite or ``null``, lists bounded. GPU and MIG UUIDs, which end
up in a printed command (``ssh HOST devicekit run --gpu-ids ...``), must look like identifiers;
a GPU entry without a valid index and UUID is left out, with a warning saying so. A document
that is no status document, or whose lists are longer than any real machine's, is refused
with one line (:class:`~devicekit.serve.peer_fetch.PeerError`).

Usage::

    from devicekit.serve.peer_document import clean_status

    doc = clean_status(json.loads(body))      # PeerError: "is not a devicekit status ..."
    doc["gpus"][0]["leases"][0]["job"]
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from devicekit.serve.peer_fetch import PeerError

__all__ = ["clean_status", "is_identifier", "MAX_GPUS", "MAX_ITEMS", "MAX_TEXT"]

#: GPUs one peer may list (a DGX has 8; MIG instances are listed under their GPU)
MAX_GPUS = 64
#: processes, leases or MIG instances per GPU; queue entries per machine
MAX_ITEMS = 256
#: the longest text kept from a peer (a command line)
MAX_TEXT = 300
_MAX_WARNINGS = 20
_IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
_BIG = 2**62

Cleaner = Callable[[Any], Any]


def is_identifier(value: Any) -> bool:
    """Whether ``value`` is safe as a word of a shell command (a GPU or MIG UUID, an index)."""
    return isinstance(value, str) and bool(_IDENTIFIER.fullmatch(value))


def _text(limit: int = MAX_TEXT) -> Cleaner:
    def clean(value: Any) -> str | None:
        return value[:limit] if isinstance(value, str) else None
    return clean


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, int):
        return value if abs(value) < _BIG else None
    return value if math.isfinite(value) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _BIG \
        else None


def _flag(value: Any) -> bool:
    return value is True


def _identifier(value: Any) -> str | None:
    return value if is_identifier(value) else None


def _texts(limit: int, items: int) -> Cleaner:
    def clean(value: Any) -> list[str]:
        if not isinstance(value, list):
            return []
        return [v[:limit] for v in value[:items] if isinstance(v, str)]
    return clean


def _numbers(value: Any) -> list[float] | None:
    if not isinstance(value, list) or len(value) > 3:
        return None
    numbers = [_number(v) for v in value]
    return None if any(n is None for n in numbers) else numbers  # type: ignore[return-value]


LEASE: dict[str, Cleaner] = {
    "gpu_uuid": _text(130), "pid": _count, "user": _text(100), "host": _text(100),
    "command": _text(), "since": _number, "memory": _count, "share": _flag, "kind": _text(10),
    "stopped_since": _number, "job": _text(64), "idle_since": _number,
}
PROCESS: dict[str, Cleaner] = {"pid": _count, "user": _text(100), "command": _text(),
                               "memory": _count}
TICKET: dict[str, Cleaner] = {
    "ticket": _text(20), "user": _text(100), "pid": _count, "host": _text(100),
    "command": _text(), "gpus_asked": _count, "filters": _text(200), "since": _number,
    "time_limit": _number, "reserved": _texts(40, MAX_GPUS),
    "reserved_uuids": _texts(130, MAX_GPUS), "reason": _text(), "backfill": _flag,
}
HOST: dict[str, Cleaner] = {
    "hostname": _text(100), "cpu_count_logical": _count, "cpu_count_physical": _count,
    "load_average": _numbers, "memory_total": _count, "memory_available": _count,
    "memory_used": _count, "usable_cpus": _count,
}
GPU_FACTS: dict[str, Cleaner] = {
    "name": _text(100), "pci_bus_id": _text(40), "memory_total": _count, "memory_used": _count,
    "memory_free": _count, "utilization": _number, "memory_bandwidth_utilization": _number,
    "temperature": _number, "power_draw": _number, "power_limit": _number,
    "compute_capability": _text(10), "compute_mode": _text(30), "mig_enabled": _flag,
    "backend": _text(20), "blocked": _text(),
}
MIG_FACTS: dict[str, Cleaner] = {"name": _text(100), "memory_total": _count,
                                 "memory_used": _count, "memory_free": _count}


def _fields(entry: Any, spec: dict[str, Cleaner]) -> dict[str, Any]:
    entry = entry if isinstance(entry, dict) else {}
    return {key: clean(entry.get(key)) for key, clean in spec.items()}


def _items(value: Any, what: str, limit: int = MAX_ITEMS) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise PeerError(f"is not a devicekit status document ({what} is not a list)")
    if len(value) > limit:
        raise PeerError(f"lists {len(value)} {what}, more than the {limit} a machine has: refused")
    return [v for v in value if isinstance(v, dict)]


def _leases(value: Any) -> list[dict[str, Any]]:
    return [_fields(lease, LEASE) for lease in _items(value, "leases")]


def _gpu(entry: dict[str, Any], dropped: list[str]) -> dict[str, Any] | None:
    index, uuid = _count(entry.get("index")), _identifier(entry.get("uuid"))
    if index is None or uuid is None:
        dropped.append("a GPU entry without a valid index and UUID was left out")
        return None
    gpu = {"index": index, "uuid": uuid, **_fields(entry, GPU_FACTS)}
    migs = []
    for mig in _items(entry.get("mig_devices"), "MIG instances"):
        mig_index, mig_uuid = _count(mig.get("index")), _identifier(mig.get("uuid"))
        if mig_index is None or mig_uuid is None:
            dropped.append(f"a MIG instance of GPU {index} without a valid index and UUID was "
                           "left out")
            continue
        migs.append({"index": mig_index, "uuid": mig_uuid, **_fields(mig, MIG_FACTS),
                     "leases": _leases(mig.get("leases"))})
    gpu["mig_devices"] = migs
    gpu["processes"] = [_fields(p, PROCESS) for p in _items(entry.get("processes"), "processes")]
    gpu["leases"] = _leases(entry.get("leases"))
    return gpu


def clean_status(doc: Any) -> dict[str, Any]:
    """The checked copy of a peer's ``/api/status`` document (see the module doc)."""
    if not isinstance(doc, dict) or doc.get("schema") != 1 or not isinstance(doc.get("gpus"), list):
        raise PeerError("did not send a devicekit status document (schema 1): is it devicekit "
                        "serve?")
    dropped: list[str] = []
    gpus = [_gpu(g, dropped) for g in _items(doc["gpus"], "GPUs", MAX_GPUS)]
    warnings = _texts(MAX_TEXT, _MAX_WARNINGS)(doc.get("warnings"))
    out: dict[str, Any] = {
        "schema": 1,
        "devicekit_version": _text(40)(doc.get("devicekit_version")),
        "taken_at": _number(doc.get("taken_at")),
        "host": _fields(doc.get("host"), HOST),
        "backend": _text(20)(doc.get("backend")),
        "driver_version": _text(40)(doc.get("driver_version")),
        "cuda_driver_version": _text(20)(doc.get("cuda_driver_version")),
        "gpus": [g for g in gpus if g is not None],
        "other_leases": _leases(doc.get("other_leases")),
        "warnings": warnings + [f"from this peer's document: {d}" for d in dropped[:5]],
    }
    if "queue" in doc:
        out["queue"] = [_fields(t, TICKET) for t in _items(doc.get("queue"), "queue entries",
                                                           4 * MAX_ITEMS)]
    return out
