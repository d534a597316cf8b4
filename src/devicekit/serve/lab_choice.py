"""Where a job of N GPUs can run now, across the lab: the best host, and why not for the others.

Each host's checked status document is judged by selection's own filters
(:func:`devicekit.selection.candidates.assess`, the same code ``devicekit select`` runs on one
machine): a GPU qualifies when no lease holds it and it passes ``--min-free`` / ``--max-util``.
What the document adds on top, as ``select`` does locally: a GPU whose lock file is squatted
(``blocked``) or that the host's fair queue keeps for a waiting ticket (``reserved_uuids``) does
not qualify either. Nothing is leased here: the answer is a host and GPU ids to hand to
``ssh HOST devicekit run --gpu-ids ...``, which leases them (or says they were taken since).
The best host is the one whose chosen GPUs have the most free memory together; ties go to the
host listed first. The host's own quota policy is not in its document and is not judged.

Usage::

    from devicekit.selection.gpu_request import make_request
    from devicekit.serve.lab_choice import choose_host

    choice = choose_host(answers, make_request(2, min_free_memory="20GiB"))
    if choice.best:
        print(choice.best.label, choice.best.value("uuid"))   # gpu3 GPU-...,GPU-...
    for verdict in choice.others:
        print(verdict.label, verdict.why)
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devicekit.hardware.gpu import GPU, GPUProcess, MigDevice
from devicekit.hardware.mig import leasable_devices
from devicekit.selection.candidates import Candidate, assess
from devicekit.selection.gpu_request import Request
from devicekit.selection.look import Look
from devicekit.selection.ranking import choose, rejected
from devicekit.serve.lab import HostAnswer
from devicekit.serve.peer_document import is_identifier
from devicekit.serve.people import gpus_asked, queue_tickets
from devicekit.sharing.lease_records import LeaseRecord
from devicekit.sharing.policy import Policy

__all__ = ["HostVerdict", "LabChoice", "choose_host", "host_devices", "start_command"]

#: how many GPU reasons one host's line quotes before "and N more"
_REASONS_SHOWN = 4


@dataclass(frozen=True)
class HostVerdict:
    """One host judged: the GPUs chosen there ([] when too few qualify) and why not."""

    answer: HostAnswer
    chosen: tuple[Candidate, ...]
    #: one line per GPU not chosen (selection's own wording)
    reasons: tuple[str, ...]
    #: one line: why this host is not the answer ("" when it qualifies)
    why: str

    @property
    def label(self) -> str:
        return self.answer.label

    @property
    def free_memory(self) -> int:
        return sum(c.available for c in self.chosen)

    def value(self, fmt: str = "uuid") -> str:
        """The chosen GPUs as ``--gpu-ids`` takes them: UUIDs, or indices (``fmt="index"``;
        a MIG instance is always named by its UUID)."""
        return ",".join(str(c.gpu.index) if fmt == "index" and not c.gpu.is_mig else c.gpu.uuid
                        for c in self.chosen)


@dataclass(frozen=True)
class LabChoice:
    """Every host's verdict, in the order given, and the best qualifying one (or None)."""

    verdicts: tuple[HostVerdict, ...]
    best: HostVerdict | None

    @property
    def others(self) -> list[HostVerdict]:
        return [v for v in self.verdicts if v is not self.best]


def _gpu(entry: dict[str, Any]) -> GPU:
    migs = tuple(MigDevice(index=m["index"], uuid=m["uuid"], name=m.get("name") or "",
                           memory_total=m.get("memory_total") or 0,
                           memory_used=m.get("memory_used") or 0)
                 for m in entry.get("mig_devices", []))
    processes = tuple(GPUProcess(pid=p.get("pid") or 0, user=p.get("user"),
                                 command=p.get("command"), memory=p.get("memory"))
                      for p in entry.get("processes", []))
    total, used = entry.get("memory_total") or 0, entry.get("memory_used") or 0
    free = entry.get("memory_free")
    return GPU(index=entry["index"], uuid=entry["uuid"], name=entry.get("name") or "",
               memory_total=total, memory_used=used,
               memory_free=max(total - used, 0) if free is None else free,
               utilization=entry.get("utilization"),
               memory_bandwidth_utilization=entry.get("memory_bandwidth_utilization"),
               compute_mode=entry.get("compute_mode"), mig_enabled=bool(entry.get("mig_enabled")),
               mig_devices=migs, processes=processes, backend="peer")


def _lease(entry: dict[str, Any]) -> LeaseRecord:
    return LeaseRecord(gpu_uuid=entry.get("gpu_uuid") or "", pid=entry.get("pid") or 0,
                       user=entry.get("user") or "?", host=entry.get("host") or "",
                       command=entry.get("command") or "", since=float(entry.get("since") or 0),
                       memory=entry.get("memory"), share=bool(entry.get("share")),
                       kind=entry.get("kind") or "lease", job=entry.get("job"))


def host_devices(status: dict[str, Any]) -> Look:
    """A checked peer document as selection's :class:`Look`: its GPUs (and MIG instances), all
    visible, with its leases; no lease directory of ours is read."""
    gpus = tuple(_gpu(g) for g in status.get("gpus", []))
    seen: set[tuple[str, int, float]] = set()
    leases = []
    for entry in [lease for g in status.get("gpus", []) for lease in g.get("leases", [])] + \
            list(status.get("other_leases", [])):
        record = _lease(entry)
        key = (record.gpu_uuid, record.pid, record.since)
        if key not in seen:
            seen.add(key)
            leases.append(record)
    devices = tuple(leasable_devices(gpus))
    return Look(gpus=gpus, devices=devices, visible=frozenset(d.uuid for d in devices),
                visible_note="", directory=Path("/nonexistent"), policy=Policy(),
                leases=tuple(leases))


def _kept(status: dict[str, Any]) -> dict[str, str]:
    """Devices the host itself would not hand out: squatted lock files, queue reservations."""
    kept = {g["uuid"]: f"blocked: {g['blocked']}" for g in status.get("gpus", []) if g.get("blocked")}
    for ticket in queue_tickets(status):
        for uuid in ticket.get("reserved_uuids") or []:
            kept.setdefault(str(uuid), f"reserved for ticket {ticket.get('ticket')} "
                                       f"({ticket.get('user')}, {gpus_asked(ticket)} GPU(s))")
    return kept


def judge_host(answer: HostAnswer, request: Request) -> HostVerdict:
    """One host's verdict for ``request``."""
    if answer.status is None or answer.error is not None:
        return HostVerdict(answer, (), (), f"no answer: {answer.error or 'not read yet'}")
    look = host_devices(answer.status)
    if not look.devices:
        return HostVerdict(answer, (), (), "no GPUs")
    kept = _kept(answer.status)
    candidates = [c.refused(kept[c.gpu.uuid]) if c.eligible and c.gpu.uuid in kept else c
                  for c in assess(look, request)]
    candidates = [c if is_identifier(c.gpu.uuid) else c.refused("malformed UUID", lasting=True)
                  for c in candidates]
    chosen = choose(candidates, request)
    reasons = tuple(rejected(candidates, chosen, request))
    if chosen:
        return HostVerdict(answer, tuple(chosen), reasons, "")
    eligible = sum(1 for c in candidates if c.eligible)
    wanted = request.count if request.count is not None else 1
    why = [r for r in reasons if "eligible but not needed" not in r]
    shown = "; ".join(why[:_REASONS_SHOWN]) + (
        f"; and {len(why) - _REASONS_SHOWN} more" if len(why) > _REASONS_SHOWN else "")
    return HostVerdict(answer, (), reasons,
                       f"{eligible} of {wanted} GPU(s) qualify" + (f": {shown}" if shown else ""))


def choose_host(answers: Sequence[HostAnswer], request: Request) -> LabChoice:
    """Every host judged; the best qualifying one (most free memory chosen; first on a tie)."""
    verdicts = tuple(judge_host(a, request) for a in answers)
    qualifying = [v for v in verdicts if v.chosen]
    best = max(qualifying, key=lambda v: v.free_memory, default=None)  # max keeps the first tie
    return LabChoice(verdicts, best)


def start_command(verdict: HostVerdict, fmt: str = "uuid") -> str:
    """``ssh HOST devicekit run --gpu-ids A,B -- COMMAND``: how to start the job there."""
    host = verdict.answer.peer.host if verdict.answer.peer is not None else verdict.label
    return (f"ssh {shlex.quote(host)} devicekit run --gpu-ids "
            f"{shlex.quote(verdict.value(fmt))} -- COMMAND")
