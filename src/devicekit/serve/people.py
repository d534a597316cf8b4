"""Per-user totals from a status document: processes, GPU memory, leases and waiting jobs.

The page's "who uses what" table and the ``devicekit_user_*`` metrics both come from
:func:`user_totals`, so they always agree. Users are bounded: past :data:`MAX_USERS` names,
the smallest are summed into one ``(other)`` row, so a metric's label set never grows without
limit. Processes whose owner the driver does not say count for ``(unknown)``.

Usage::

    from devicekit.serve.people import user_totals

    for row in user_totals(doc):
        print(row.user, row.processes, row.gpu_memory, row.leased_devices, row.waiting_jobs)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from devicekit.sharing.queue_state import QueueEntryDoc

__all__ = ["MAX_USERS", "OTHER", "UNKNOWN", "UserTotals", "user_totals", "all_leases",
           "queue_tickets", "gpus_asked"]

MAX_USERS = 50
OTHER = "(other)"
UNKNOWN = "(unknown)"


@dataclass
class UserTotals:
    """What one user holds and waits for."""

    user: str
    processes: int = 0
    #: GPU memory held by the user's processes, bytes (processes of unknown size count 0)
    gpu_memory: int = 0
    #: devices (GPUs or MIG instances) with at least one of the user's leases
    leased: set[str] = field(default_factory=set)
    waiting_jobs: int = 0
    waiting_gpus: int = 0
    #: when the user's longest-waiting job joined the queue (None: nothing waits)
    waiting_since: float | None = None

    @property
    def leased_devices(self) -> int:
        return len(self.leased)

    def add(self, other: UserTotals) -> None:
        self.processes += other.processes
        self.gpu_memory += other.gpu_memory
        self.leased |= other.leased
        self.waiting_jobs += other.waiting_jobs
        self.waiting_gpus += other.waiting_gpus
        self.waiting_since = _earliest(self.waiting_since, other.waiting_since)


def all_leases(doc: dict[str, Any]) -> Iterator[tuple[dict[str, Any] | None, dict[str, Any]]]:
    """``(gpu entry or None, lease)`` for every lease: on a GPU, a MIG instance, or no GPU here.

    A GPU entry's ``leases`` already holds its MIG instances' leases, so each is seen once.
    """
    for gpu in doc.get("gpus", []):
        for lease in gpu.get("leases", []):
            yield gpu, lease
    for lease in doc.get("other_leases", []):
        yield None, lease


def queue_tickets(doc: dict[str, Any]) -> list[QueueEntryDoc]:
    """The waiting tickets when the document has a ``queue`` list (the fair queue); else []."""
    queue = doc.get("queue")
    if isinstance(queue, dict):  # tolerate {"tickets": [...]} as well as a bare list
        queue = queue.get("tickets")
    if not isinstance(queue, list):
        return []
    return [cast(QueueEntryDoc, t) for t in queue if isinstance(t, dict)]


def gpus_asked(ticket: QueueEntryDoc) -> int:
    """How many GPUs a waiting ticket asks for: its ``gpus_asked`` (1 when that is no count)."""
    asked = ticket.get("gpus_asked")
    if isinstance(asked, int) and not isinstance(asked, bool):
        return max(asked, 0)
    return 1


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _name(value: Any) -> str:
    return str(value) if value not in (None, "") else UNKNOWN


def user_totals(doc: dict[str, Any], limit: int = MAX_USERS) -> list[UserTotals]:
    """One row per user, busiest first; at most ``limit`` rows (the rest summed as ``(other)``)."""
    rows: dict[str, UserTotals] = {}

    def row(user: Any) -> UserTotals:
        name = _name(user)
        return rows.setdefault(name, UserTotals(name))

    for gpu in doc.get("gpus", []):
        for proc in gpu.get("processes", []):
            entry = row(proc.get("user"))
            entry.processes += 1
            entry.gpu_memory += int(proc.get("memory") or 0)
    for _, lease in all_leases(doc):
        row(lease.get("user")).leased.add(str(lease.get("gpu_uuid")))
    for ticket in queue_tickets(doc):
        entry = row(ticket.get("user"))
        entry.waiting_jobs += 1
        entry.waiting_gpus += gpus_asked(ticket)
        since = ticket.get("since")
        if isinstance(since, int | float) and not isinstance(since, bool):
            entry.waiting_since = _earliest(entry.waiting_since, float(since))
    ranked = sorted(rows.values(), key=lambda r: (-r.leased_devices, -r.gpu_memory,
                                                   -r.waiting_jobs, r.user))
    if len(ranked) <= limit:
        return ranked
    other = UserTotals(OTHER)
    for extra in ranked[limit - 1:]:
        other.add(extra)
    return [*ranked[:limit - 1], other]
