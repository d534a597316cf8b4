"""The filters: every device judged against a request, with the reasons it cannot be used.

:func:`assess` is pure (no I/O): it takes a :class:`~devicekit.selection.look.Look`'s facts and
returns one :class:`Candidate` per device, in NVML order. Reasons no wait can remove (hidden,
excluded, MIG mode, too small) are *lasting*; the others (leased, busy, too full) may pass.

Usage::

    from devicekit.selection.candidates import assess
    from devicekit.selection.look import take_look
    from devicekit.selection.gpu_request import make_request

    look = take_look()
    for c in assess(look, make_request(1, min_free_memory="10GiB")):
        print(c.gpu.label, c.eligible, c.reasons)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

from devicekit.hardware.gpu import GPU
from devicekit.selection.exclude import excluded as excluded_uuids
from devicekit.selection.gpu_request import Request
from devicekit.selection.look import Look
from devicekit.sharing.lease_records import LeaseRecord
from devicekit.units import format_size

__all__ = ["Candidate", "assess", "holder_pids"]


@dataclass(frozen=True)
class Candidate:
    """One GPU as selection judged it: ``available`` bytes and the reasons it cannot be used."""

    gpu: GPU
    available: int
    reasons: tuple[str, ...]
    #: reasons no amount of waiting removes (hidden, excluded, MIG, too small); a subset
    lasting: tuple[str, ...] = ()

    @property
    def eligible(self) -> bool:
        return not self.reasons

    @property
    def possible(self) -> bool:
        """Whether this GPU could qualify once its users leave (nothing lasting stands in the way)."""
        return not self.lasting

    def line(self) -> str:
        return f"{self.gpu.label}: {'; '.join(self.reasons)}"

    def refused(self, why: str, *, lasting: bool = False) -> Candidate:
        """This candidate, ineligible for ``why`` (which replaces the passing reasons)."""
        return replace(self, reasons=(why,), lasting=(why,) if lasting else self.lasting)


def assess(look: Look, request: Request, devices: Sequence[GPU] | None = None,
           leases: Sequence[LeaseRecord] | None = None) -> list[Candidate]:
    """Judge ``devices`` (default: all of the look's) against the request, in NVML order.

    ``leases`` replaces the look's (a share budget judged with the device locked).
    """
    devices = look.devices if devices is None else devices
    leases = look.leases if leases is None else leases
    holders = holder_pids(leases)
    excluded = excluded_uuids(look.devices, request.exclude)
    return [_judge(gpu, leases, request, look, gpu.uuid in excluded, holders) for gpu in devices]


def _judge(gpu: GPU, leases: Sequence[LeaseRecord], request: Request, look: Look,
           excluded: bool, holder_pids: dict[int, set[int]]) -> Candidate:
    reasons: list[str] = []
    lasting: list[str] = []
    on_gpu = [r for r in leases if r.gpu_uuid == gpu.uuid]
    available = gpu.memory_free + sum(
        p.memory or 0 for p in gpu.processes if p.user in request.account_as_free)
    available = min(available, gpu.memory_total)
    if gpu.uuid not in look.visible:
        lasting.append(f"hidden by {look.visible_note}")
    if excluded:
        lasting.append("excluded")
    if gpu.mig_enabled:
        lasting.append("in MIG mode without MIG instances (create them with 'nvidia-smi mig')")
    if gpu.is_mig and request.count != 1:
        lasting.append("a MIG instance: CUDA gives a process one MIG instance, so only a "
                       "request for 1 device gets one")
    if gpu.compute_mode == "prohibited":
        lasting.append("compute mode is prohibited")
    if request.min_free is not None and gpu.memory_total < request.min_free:
        lasting.append(f"{format_size(gpu.memory_total)} total < "
                       f"{format_size(request.min_free)} asked")
    if lasting:  # the passing reasons would only add noise
        return Candidate(gpu, available, tuple(lasting), tuple(lasting))
    if gpu.compute_mode == "exclusive_process" and gpu.processes:
        reasons.append(f"compute mode is exclusive_process and pid {gpu.processes[0].pid} uses it")
    exclusive = [r for r in on_gpu if not r.share]
    if exclusive:
        reasons.append(exclusive[0].describe())
    elif on_gpu and not request.share:
        reasons.append(f"shared by {len(on_gpu)} lease(s): {on_gpu[0].describe()}")
    elif on_gpu:
        # share leases budget memory: what each holder asked minus what it already uses
        available -= sum(max((r.memory or 0) - _used_by(gpu, holder_pids.get(r.pid, {r.pid})), 0)
                         for r in on_gpu)
    if request.min_free is not None and available < request.min_free:
        what = "free" if not on_gpu else "free after shared leases"
        reasons.append(f"{format_size(max(available, 0))} {what} < "
                       f"{format_size(request.min_free)} asked")
    if (request.max_util is not None and gpu.utilization is not None
            and gpu.utilization > request.max_util):
        reasons.append(f"utilization {gpu.utilization:g}% > {request.max_util:g}% asked")
    return Candidate(gpu, available, tuple(reasons))


def _used_by(gpu: GPU, pids: set[int]) -> int:
    """GPU memory that the processes ``pids`` hold on ``gpu``."""
    return sum(p.memory or 0 for p in gpu.processes if p.pid in pids)


def holder_pids(leases: Sequence[LeaseRecord]) -> dict[int, set[int]]:
    """For share leases held on this host: the holder's pid and all its descendants' pids
    (the processes that use memory on the lease's behalf, e.g. the command ``devicekit run``
    started)."""
    here = os.uname().nodename
    pids = {r.pid for r in leases if r.share and r.host == here}
    if not pids:
        return {}
    import psutil

    out: dict[int, set[int]] = {}
    for pid in pids:
        try:
            out[pid] = {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
        except psutil.Error:
            out[pid] = {pid}
    return out
