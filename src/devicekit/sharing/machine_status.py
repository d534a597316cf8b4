"""The whole machine at one instant: host, backend, every GPU and its leases (``devicekit status``).

:func:`collect_status` gathers it; :meth:`StatusReport.to_dict` is the stable, versioned JSON
document that ``devicekit status --json`` prints (schema documented in ``docs/cli.md``; fields are
only ever added within one ``schema`` number, never renamed or removed). No torch import.

Usage::

    from devicekit.sharing.machine_status import collect_status

    report = collect_status()
    print(report.backend, len(report.gpus), report.warnings)
    doc = report.to_dict()          # {"schema": 1, "host": {...}, "gpus": [...], ...}

Whatever other users wrote reaches the document bounded: each lease's fields by its schema
(:mod:`~devicekit.sharing.lease_document`), the lists by :mod:`~devicekit.sharing.status_ceiling`
(at most 32 leases per device, the rest counted), so the document has a ceiling.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devicekit.errors import LeaseError
from devicekit.hardware.document_fields import IgnoredFile
from devicekit.hardware.gpu import GPU
from devicekit.hardware.host import Host
from devicekit.sharing.status_ceiling import (
    MAX_IGNORED_LISTED,
    MAX_QUEUE_LISTED,
    ceiling_warnings,
    ignored_warnings,
    listed,
)

if TYPE_CHECKING:
    from devicekit.sharing.leases import LeaseRecord
    from devicekit.sharing.queue_state import QueueEntryDoc

__all__ = ["SCHEMA_VERSION", "StatusReport", "collect_status", "leases_by_gpu"]

#: version of the ``devicekit status --json`` document; bumped only on incompatible changes
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class StatusReport:
    """Host facts, the backend in force, GPU snapshots and the live leases, taken together."""

    host: Host
    backend: str
    driver_version: str | None
    cuda_driver_version: str | None
    gpus: tuple[GPU, ...]
    leases: tuple[LeaseRecord, ...] = ()
    #: problems that did not stop the report (e.g. an unreadable lease directory)
    warnings: tuple[str, ...] = ()
    taken_at: float = field(default_factory=time.time)
    #: devices whose lock file another user made unusable: uuid -> why (``run`` refuses them)
    blocked: Mapping[str, str] = field(default_factory=dict)
    #: lease holders (pids) whose job is stopped (Ctrl-Z, SIGSTOP) -> since when
    stopped: Mapping[int, float] = field(default_factory=dict)
    #: the fair queue's waiting tickets (``devicekit queue --json``'s entries), in queue order
    queue: tuple[QueueEntryDoc, ...] = ()
    #: live lease files that failed their schema: not counted as leases, shown with their owner
    ignored_leases: tuple[IgnoredFile, ...] = ()

    def leases_for(self, gpu: GPU) -> list[LeaseRecord]:
        """Live leases on ``gpu`` (its own UUID or one of its MIG instances)."""
        return leases_by_gpu([gpu], self.leases)[0].get(gpu.uuid, [])

    def to_dict(self) -> dict[str, Any]:
        """The ``devicekit status --json`` document (schema :data:`SCHEMA_VERSION`)."""
        from devicekit.hardware.capability import capabilities
        from devicekit.version import __version__

        by_gpu, orphans = leases_by_gpu(self.gpus, self.leases)
        gpus = []
        for gpu, cap in zip(self.gpus, capabilities(self.gpus), strict=True):
            entry = gpu.to_dict()
            entry["capability"] = {"score": round(cap.score, 1), "source": cap.source}
            held = by_gpu.get(gpu.uuid, [])
            for mig, mig_entry in zip(gpu.mig_devices, entry["mig_devices"], strict=True):
                mig_entry["memory_free"] = mig.memory_free
                listed(mig_entry, "leases", [_lease_dict(r) for r in held if r.gpu_uuid == mig.uuid])
            listed(entry, "leases", [_lease_dict(r, self.stopped) for r in held])
            entry["blocked"] = self.blocked.get(gpu.uuid)
            gpus.append(entry)
        doc: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "devicekit_version": __version__,
            "taken_at": self.taken_at,
            "host": self.host.to_dict(),
            "backend": self.backend,
            "driver_version": self.driver_version,
            "cuda_driver_version": self.cuda_driver_version,
            "gpus": gpus,
            "other_leases": [_lease_dict(r, self.stopped) for r in orphans],
            "warnings": list(self.warnings),
            **({"queue": list(self.queue)} if self.queue else {}),  # only while tickets wait
        }
        # the ceiling: lists other users can grow are cut, the rest counted
        listed(doc, "other_leases", doc["other_leases"])
        doc["warnings"] = ceiling_warnings(doc["warnings"])
        listed(doc, "ignored_leases", [{"file": i.name, "user": i.user, "why": i.why}
                                       for i in self.ignored_leases], limit=MAX_IGNORED_LISTED)
        if "queue" in doc:
            listed(doc, "queue", doc["queue"], limit=MAX_QUEUE_LISTED)
        return doc


def _lease_dict(record: LeaseRecord, stopped: Mapping[int, float] | None = None) -> dict[str, Any]:
    entry = asdict(record)
    entry["stopped_since"] = (stopped or {}).get(record.pid)  # None: running
    return entry


def leases_by_gpu(gpus: Iterable[GPU], leases: Sequence[LeaseRecord]
                  ) -> tuple[dict[str, list[LeaseRecord]], list[LeaseRecord]]:
    """Group leases by the UUID of the physical GPU they hold (MIG leases count for their GPU).

    Returns ``(uuid -> leases, leases on no GPU present)``.
    """
    owner: dict[str, str] = {}
    for gpu in gpus:
        owner[gpu.uuid] = gpu.uuid
        for mig in gpu.mig_devices:
            owner[mig.uuid] = gpu.uuid
    grouped: dict[str, list[LeaseRecord]] = {}
    orphans: list[LeaseRecord] = []
    for record in leases:
        parent = owner.get(record.gpu_uuid)
        if parent is None:
            orphans.append(record)
        else:
            grouped.setdefault(parent, []).append(record)
    return grouped, orphans


def _lease_dir_exists() -> bool:
    from devicekit.sharing.lease_directory import DEFAULT_LEASE_DIR, LEASE_DIR_ENV

    raw = os.environ.get(LEASE_DIR_ENV) or DEFAULT_LEASE_DIR
    return os.path.lexists(Path(raw).expanduser())  # lexists: a symlink is reported, not followed


def collect_status(*, include_leases: bool = True) -> StatusReport:
    """Snapshot the host, every GPU and the live leases.

    A broken lease directory does not hide the GPUs: it becomes a warning in the report.
    A failing GPU driver raises :class:`~devicekit.errors.BackendError`.
    """
    from devicekit.hardware.host import host
    from devicekit.hardware.inventory import backend

    source = backend()
    gpus = tuple(source.snapshot())
    cuda_version = getattr(source, "cuda_driver_version", None)
    warnings: list[str] = []
    reason = getattr(source, "reason", None)
    if source.name == "none" and reason:
        warnings.append(str(reason))
    warnings.extend(str(p) for p in getattr(source, "problems", ()))
    if gpus:
        from devicekit.hardware.container import pid_isolation

        # simulated processes are made up: only NVML's pids say anything about this /proc
        pids = [p.pid for g in gpus for p in g.processes] if source.name == "nvml" else []
        hidden = pid_isolation(pids).note()
        if hidden:
            warnings.append(hidden)  # GPUs that look unused may be used from outside
    leases: tuple[LeaseRecord, ...] = ()
    tickets: Any = None
    ignored: list[IgnoredFile] = []
    if include_leases and _lease_dir_exists():  # a read-only look: never create the directory
        from devicekit.sharing.lease_directory import lease_dir
        from devicekit.sharing.queue_state import read_moment

        try:  # leases and queue tickets as they were at one moment
            got, tickets = read_moment(lease_dir(), ignored)
            leases = tuple(got)
        except LeaseError as exc:
            warnings.append(f"leases not shown: {exc}")
        warnings.extend(ignored_warnings(ignored))
    blocked, stopped = _lease_trouble(gpus, leases, warnings) if include_leases else ({}, {})
    queue: tuple[QueueEntryDoc, ...] = ()
    if include_leases and not any(w.startswith("leases not shown") for w in warnings) \
            and _lease_dir_exists():
        from devicekit.sharing.queue_state import waiting_entries

        try:  # the fair queue: waiting tickets, their reserved GPUs and reasons
            queue = tuple(waiting_entries(gpus, leases, tickets))
        except LeaseError as exc:
            warnings.append(f"queue not shown: {exc}")
        warnings.extend(_policy_warning())
    return StatusReport(
        host=host(),
        backend=source.name,
        driver_version=source.driver_version(),
        cuda_driver_version=cuda_version() if callable(cuda_version) else None,
        gpus=gpus,
        leases=leases,
        warnings=tuple(warnings),
        blocked=blocked,
        stopped=stopped,
        queue=queue,
        ignored_leases=tuple(ignored),
    )


def _policy_warning() -> list[str]:
    """The queue policy's note when the admin's policy.toml is ignored (no quotas then)."""
    from devicekit.sharing.lease_directory import lease_dir
    from devicekit.sharing.policy import load_policy

    try:
        note = load_policy(lease_dir()).note
    except LeaseError:
        return []
    return [f"queue policy {note}: no quotas or limits are in force"] if note else []


def _lease_trouble(gpus: Sequence[GPU], leases: Sequence[LeaseRecord], warnings: list[str]
                   ) -> tuple[dict[str, str], dict[int, float]]:
    """Squatted lock files and stopped lease holders, each also as a warning line."""
    if not _lease_dir_exists():
        return {}, {}
    from devicekit.hardware.printable import printable
    from devicekit.sharing.lease_directory import lease_dir
    from devicekit.sharing.lock_squatting import blocked_devices
    from devicekit.sharing.stopped_jobs import stopped_since

    try:
        directory = lease_dir()
    except LeaseError:
        return {}, {}
    devices = [(g.index, g.uuid) for g in gpus] + [(f"{g.index}/{m.index}", m.uuid)
                                                  for g in gpus for m in g.mig_devices]
    blocked = blocked_devices(directory, [uuid for _, uuid in devices])
    for label, uuid in devices:
        if uuid in blocked:
            warnings.append(f"GPU {label} is {blocked[uuid]}")
    stopped: dict[int, float] = {}
    here = os.uname().nodename
    for record in leases:
        if record.host != here or record.pid in stopped:
            continue
        since = stopped_since(directory, record.pid, _uid_of(record.user))
        if since is not None:
            stopped[record.pid] = since
            warnings.append(f"the job of {printable(record.user)} (pid {record.pid}, "
                            f"{printable(record.command)[:60]}) is stopped since "
                            f"{time.strftime('%H:%M:%S', time.localtime(since))} and holds its "
                            "GPU(s): resume it (fg, kill -CONT) or end it")
    return blocked, stopped


def _uid_of(user: str) -> int | None:
    import pwd

    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return int(user) if user.isdigit() else None
