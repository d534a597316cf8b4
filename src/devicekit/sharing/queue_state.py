"""The queue as it stands: tickets, held GPUs and policy read together, every ticket decided.

:func:`look` reads the lease directory once (tickets, policy) and takes the GPU snapshot and
live leases the caller already has, then runs :func:`~devicekit.sharing.queue_order.decide`.
Selection uses it to keep GPUs reserved for a ticket away from everyone else and to learn its
own ticket's turn; ``devicekit queue`` and ``devicekit status`` show it.

Usage::

    from devicekit.sharing.queue_state import look

    view = look(directory, devices, leases)
    for entry in view.waiting:
        print(entry.record.ticket, entry.decision.reason)
    print(view.reserved)          # {uuid: "reserved for ticket 3 (alice, 4 GPUs)"}
    doc: QueueEntryDoc = view.waiting[0].to_dict()   # doc["gpus_asked"], doc["reason"], ...
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from devicekit.hardware.document_fields import IgnoredFile
from devicekit.hardware.gpu import GPU
from devicekit.sharing.lease_records import LeaseRecord
from devicekit.sharing.policy import Policy, load_policy
from devicekit.sharing.queue_order import Busy, Decision, Waiting, decide
from devicekit.sharing.tickets import IgnoredTicket, TicketFiles, TicketRecord, read_ticket_files
from devicekit.units import format_size

__all__ = ["QueueEntry", "QueueEntryDoc", "QueueView", "look", "read_moment", "waiting_entries",
           "QUEUE_SCHEMA"]

#: version of the ``devicekit queue --json`` document (fields only added within one number)
QUEUE_SCHEMA = 1


class QueueEntryDoc(TypedDict):
    """A waiting ticket as a document: ``devicekit queue --json``'s ``waiting`` entries, ``status
    --json``'s ``queue`` list, and what ``devicekit serve``'s page and metrics read. The one
    definition of its keys; :meth:`QueueEntry.to_dict` makes it."""

    ticket: str
    user: str
    pid: int
    host: str
    #: the waiter's command line (another user's text: print it inert)
    command: str
    #: how many GPUs the ticket asks for
    gpus_asked: int
    #: its filters in words (``--min-free 40 GiB --exclude 3``), "" for none
    filters: str
    #: wall-clock time the ticket was taken
    since: float
    #: declared time limit in seconds (None: none)
    time_limit: float | None
    #: GPUs kept free for it, as labels ("GPU 3") and as UUIDs
    reserved: list[str]
    reserved_uuids: list[str]
    #: why it waits: Reserved for / Busy / Quota / Filter, or "Starting"
    reason: str
    #: whether it starts on GPUs reserved for an earlier ticket (EASY backfill)
    backfill: bool


@dataclass(frozen=True)
class QueueEntry:
    """A waiting ticket and what the queue decided for it."""

    record: TicketRecord
    decision: Decision
    labels: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> QueueEntryDoc:
        r, d = self.record, self.decision
        return QueueEntryDoc(ticket=r.ticket, user=r.user, pid=r.pid, host=r.host,
                             command=r.command, gpus_asked=r.count, filters=r.filters,
                             since=r.since, time_limit=r.time_limit,
                             reserved=[self.labels.get(u, u) for u in d.reserved],
                             reserved_uuids=list(d.reserved), reason=d.reason or "Starting",
                             backfill=d.backfill)


@dataclass(frozen=True)
class QueueView:
    """Waiting tickets in queue order, time-limited running jobs, the policy in force."""

    waiting: tuple[QueueEntry, ...]
    running: tuple[TicketRecord, ...]
    policy: Policy
    labels: dict[str, str]
    #: free GPU uuid -> why it is kept for a ticket ("reserved for ticket 3 (alice, 4 GPUs)")
    reserved: dict[str, str]
    taken_at: float = field(default_factory=time.time)
    #: live ticket files the queue does not trust (malformed, a number taken twice), with why
    ignored: tuple[IgnoredTicket, ...] = ()

    def entry(self, ticket: str) -> QueueEntry | None:
        return next((e for e in self.waiting if e.record.ticket == ticket), None)

    def entry_at(self, path: str | Path) -> QueueEntry | None:
        """The entry of the ticket file ``path`` (a waiter's own: its number is only a label)."""
        return next((e for e in self.waiting if e.record.path == str(path)), None)

    def to_dict(self) -> dict[str, Any]:
        now = time.monotonic()
        running = [{"ticket": r.ticket, "user": r.user, "pid": r.pid, "command": r.command,
                    "gpus": [self.labels.get(u, u) for u in r.gpus], "gpu_uuids": list(r.gpus),
                    "since": r.since, "time_limit": r.time_limit,
                    "ends_in": None if r.ends is None else max(r.ends - now, 0.0)}
                   for r in self.running]
        return {"schema": QUEUE_SCHEMA, "taken_at": self.taken_at,
                "waiting": [e.to_dict() for e in self.waiting], "running": running,
                "ignored": [{"file": i.name, "user": i.user, "why": i.why} for i in self.ignored],
                "policy": {"path": self.policy.path or None,
                           "max_gpus_per_user": self.policy.max_gpus_per_user,
                           "default_time_limit": self.policy.default_time_limit,
                           "note": self.policy.note or None}}


def look(directory: Path, devices: Sequence[GPU], leases: Sequence[LeaseRecord], *,
         tickets: Sequence[TicketRecord] | TicketFiles | None = None,
         policy: Policy | None = None) -> QueueView:
    """Decide every live ticket of ``directory`` against ``devices`` held as ``leases`` say.

    ``tickets``: what the caller already read (records in queue order, or the files with the
    ignored ones); read here when None.
    """
    files = read_ticket_files(directory) if tickets is None else tickets
    if not isinstance(files, TicketFiles):
        files = TicketFiles(tuple(files))
    records = list(files.tickets)
    policy = load_policy(directory) if policy is None else policy
    labels = {g.uuid: g.label for g in devices}
    if not records:
        return QueueView((), (), policy, labels, {}, ignored=files.ignored)
    now = time.monotonic()
    running = [t for t in records if t.state == "running"]
    waiting = [t for t in records if t.state == "waiting"]
    # a running ticket tells when its GPUs free up, believed only for leases its own process
    # holds (a ticket file cannot speak for another user's GPUs)
    ends: dict[tuple[str, str, int], float] = {}
    for r in running:
        for u in r.gpus:
            if r.ends is not None:
                ends[(u, r.user, r.pid)] = r.ends
    busy: dict[str, Busy] = {}
    for lease in leases:
        if lease.gpu_uuid not in busy:
            busy[lease.gpu_uuid] = Busy(lease.describe(), lease.user,
                                        ends.get((lease.gpu_uuid, lease.user, lease.pid)))
    by_uuid = {g.uuid: g for g in devices}
    bonus: dict[str, float] = {}
    if policy.fair_share_half_life is not None:  # light recent users first
        from devicekit.sharing.fair_share import factors

        shares = factors(directory, {t.user for t in waiting}, policy.fair_share_half_life)
        bonus = {u: policy.fair_share_weight * f for u, f in shares.items()}
    queued = [_waiting(t, by_uuid, busy, policy, bonus.get(t.user, 0.0)) for t in waiting]
    decisions = decide(queued, [g.uuid for g in devices], busy, now,
                       max_gpus_per_user=policy.max_gpus_per_user,
                       user_limits=policy.user_limits, labels=labels)
    by_ticket = {t.ticket: t for t in waiting}
    entries = tuple(QueueEntry(by_ticket[d.ticket], d, labels) for d in decisions)
    reserved: dict[str, str] = {}
    for e in entries:
        for u in e.decision.reserved:
            reserved[u] = (f"reserved for ticket {e.record.ticket} ({e.record.user},"
                           f" {e.record.count} GPU(s))")
        for u in e.decision.grant:  # about to be taken by that ticket's waiter
            reserved[u] = (f"reserved for ticket {e.record.ticket} ({e.record.user},"
                           f" {e.record.count} GPU(s), starting)")
    return QueueView(entries, tuple(running), policy, labels, reserved, ignored=files.ignored)


#: looks at the lease directory before a view settles for one that changed while it was read
_MOMENT_TRIES = 5


def read_moment(directory: Path, ignored: list[IgnoredFile] | None = None
                ) -> tuple[list[LeaseRecord], TicketFiles]:
    """The live leases and tickets of ``directory`` as they were at one moment.

    Reading leases and then tickets can mix two moments (a job shown waiting whose lease was
    just taken, a GPU shown free whose ticket just went): the directory's modification time
    changes with every lease or ticket taken, released or rewritten (each is a file created,
    renamed or removed), so the look is repeated until it did not change while being read.
    After a few busy tries the last look is returned as it is. Nothing is cleaned up here.
    ``ignored`` (a list) receives the live lease files of that look that were not trusted.
    """
    from devicekit.sharing.lease_records import read_leases

    for _ in range(_MOMENT_TRIES):
        before = _changed_ns(directory)
        if ignored is not None:
            ignored.clear()
        leases = read_leases(directory, ignored=ignored)
        files = read_ticket_files(directory, cleanup=False)
        if before is not None and _changed_ns(directory) == before:
            break
    return leases, files


def _changed_ns(directory: Path) -> int | None:
    try:
        return os.stat(directory).st_mtime_ns
    except OSError:
        return None


def waiting_entries(gpus: Sequence[GPU], leases: Sequence[LeaseRecord] | None = None,
                    tickets: TicketFiles | None = None) -> list[QueueEntryDoc]:
    """The waiting tickets of the configured lease directory as ``devicekit status`` shows them
    (``leases`` and ``tickets`` read together by :func:`read_moment`; read here when None)."""
    from devicekit.hardware.mig import leasable_devices
    from devicekit.sharing.lease_directory import lease_dir

    directory = lease_dir()
    files = tickets
    if leases is None:
        leases, files = read_moment(directory)
    return [e.to_dict() for e in look(directory, leasable_devices(gpus), leases,
                                      tickets=files).waiting]


def _waiting(t: TicketRecord, by_uuid: dict[str, GPU], busy: dict[str, Busy],
             policy: Policy, bonus: float = 0.0) -> Waiting:
    """The ticket's usable GPUs: its candidates, and the free ones passing its memory/load filters."""
    usable = set()
    short: list[str] = []
    for u in t.candidates:
        gpu = by_uuid.get(u)
        if gpu is None:
            continue
        if u not in busy:
            if t.min_free is not None and gpu.memory_free < t.min_free:
                short.append(f"{format_size(t.min_free)} free")
                continue
            if t.max_util is not None and gpu.utilization is not None and gpu.utilization > t.max_util:
                short.append(f"utilization <= {t.max_util:g}%")
                continue
        usable.add(u)
    note = f"no {t.count} GPU(s) with {short[0]}" if short else ""
    if not note and len(usable) < t.count:
        note = f"only {len(usable)} of the GPUs asked for exist here"
    limit = t.time_limit
    return Waiting(t.ticket, t.user, t.count, frozenset(usable),
                   None if limit is None else limit + t.grace,
                   policy.priorities.get(t.user, 0.0) + bonus, note)
