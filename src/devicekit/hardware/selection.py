"""Choose free GPUs and lease them in one atomic step: ``select_gpus``.

Filters (free memory, utilization, ``exclude``, leases, ``CUDA_VISIBLE_DEVICES``), orders the
survivors, and leases the best ``count`` under the lease directory's lock, so two jobs started
at the same instant never get the same GPU. Every GPU not chosen gets one line in
``Selection.rejected`` saying why. Too few: :class:`~devicekit.errors.NoDeviceAvailable` with
those lines, or with ``wait=`` poll until enough free up, or with ``fallback="cpu"`` a CPU
selection.

Devices rule: ``Selection.devices`` are ordinals *in this process's view*, resolved when you read
them. Set ``os.environ["CUDA_VISIBLE_DEVICES"] = sel.cuda_visible_devices`` before torch touches
CUDA and they are ``cuda:0..n-1``; leave it alone and they are the chosen GPUs' positions among
the GPUs already visible; if CUDA is already initialised they are matched by UUID.

Usage::

    import devicekit as dk

    with dk.select_gpus(2, min_free_memory="20GiB", wait=600) as sel:
        print(sel.cuda_visible_devices, sel.rejected)
        model = model.to(sel.devices[0])
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from devicekit.errors import InvalidValueError, NoDeviceAvailable
from devicekit.hardware import inventory
from devicekit.hardware.exclude import excluded as excluded_uuids
from devicekit.hardware.exclude import parse_exclude
from devicekit.hardware.gpu import GPU
from devicekit.hardware.lease_directory import lease_dir
from devicekit.hardware.leases import Lease, LeaseRecord, read_leases
from devicekit.hardware.mig import leasable_devices, visible_uuids
from devicekit.hardware.policy import parse_duration
from devicekit.hardware.queue_turn import blocked, join_for, queued
from devicekit.hardware.visible import ORDER_ENV, VISIBLE_ENV, torch_ordinal, visible_value
from devicekit.hardware.waiting import WaitDisplay
from devicekit.units import format_size, parse_percent, parse_size

if TYPE_CHECKING:
    import torch

__all__ = ["ORDERS", "FORMATS", "Selection", "Candidate", "select_gpus"]

ORDERS = ("free-memory", "utilization", "fastest", "index", "random")
FORMATS = ("uuid", "index")


@dataclass
class Selection:
    """The GPUs chosen by :func:`select_gpus`, their lease, and why the others were not chosen."""

    gpus: list[GPU]
    rejected: list[str] = field(default_factory=list)
    lease: Lease | None = None
    #: True when too few GPUs were free and ``fallback="cpu"`` gave the CPU instead
    cpu_fallback: bool = False
    #: the fair queue's hold (a time-limited job's running ticket, fair-share bookkeeping),
    #: closed on release
    ticket: Any = None

    @property
    def devices(self) -> list[torch.device]:
        """``torch.device``\\ s for the chosen GPUs as *this* process numbers them (see module doc)."""
        import torch

        if self.cpu_fallback:
            return [torch.device("cpu")]
        return [torch.device("cuda", torch_ordinal(gpu)) for gpu in self.gpus]

    @property
    def cuda_visible_devices(self) -> str:
        """Value for ``CUDA_VISIBLE_DEVICES`` naming the chosen GPUs by UUID (``""``: none)."""
        return visible_value(self.gpus, "uuid")

    def visible_devices_value(self, fmt: str = "uuid") -> str:
        """``CUDA_VISIBLE_DEVICES`` value as UUIDs (``"uuid"``) or NVML indices (``"index"``)."""
        if fmt not in FORMATS:
            raise InvalidValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
        mig = [g for g in self.gpus if g.is_mig]
        if fmt == "index" and mig:
            raise InvalidValueError(
                f"format 'index' cannot name {mig[0].label} (a MIG instance has no index in "
                f"{VISIBLE_ENV}); use format 'uuid'")
        return visible_value(self.gpus, fmt)

    def to_env(self, fmt: str = "uuid") -> dict[str, str]:
        """Variables to set for a child so that its ``cuda:0..n-1`` are the chosen GPUs."""
        env = {VISIBLE_ENV: self.visible_devices_value(fmt)}
        if fmt == "index":
            env[ORDER_ENV] = "PCI_BUS_ID"  # NVML indices are PCI bus order
        return env

    def release(self) -> None:
        """Release the lease (if any) and leave the queue. Safe to call twice."""
        if self.lease is not None:
            self.lease.release()
        if self.ticket is not None:
            self.ticket.close()

    def __enter__(self) -> Selection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        what = "cpu" if self.cpu_fallback else ", ".join(g.label for g in self.gpus)
        leased = "leased" if self.lease is not None and not self.lease.released else "not leased"
        return f"Selection([{what}], {leased}, {len(self.rejected)} rejected)"


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


@dataclass(frozen=True)
class _Request:
    count: int | None  # None: all eligible
    min_free: int | None
    max_util: float | None
    exclude: tuple[str, ...]
    order: str
    account_as_free: frozenset[str]
    share: bool


def _check_count(count: Any) -> int | None:
    if count == "all":
        return None
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InvalidValueError(f"count {count!r} must be a whole number of GPUs >= 1 (or 'all')")
    return count


def assess(gpus: Sequence[GPU], leases: Sequence[LeaseRecord], request: _Request,
           visible: set[str], visible_note: str,
           holder_pids: dict[int, set[int]] | None = None) -> list[Candidate]:
    """Judge every device (GPU or MIG instance) against the request (pure: no I/O), in NVML order.

    ``holder_pids`` maps a lease's pid to the pids that use memory on its behalf (itself and
    its descendants, e.g. the command ``devicekit run`` started).
    """
    holder_pids = holder_pids or {}
    excluded = excluded_uuids(gpus, request.exclude)
    out = []
    for gpu in gpus:
        reasons: list[str] = []
        lasting: list[str] = []
        on_gpu = [r for r in leases if r.gpu_uuid == gpu.uuid]
        available = gpu.memory_free + sum(
            p.memory or 0 for p in gpu.processes if p.user in request.account_as_free)
        available = min(available, gpu.memory_total)
        if gpu.uuid not in visible:
            lasting.append(f"hidden by {visible_note}")
        if gpu.uuid in excluded:
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
        reasons.extend(lasting)
        if lasting:  # the passing reasons would only add noise
            out.append(Candidate(gpu, available, tuple(reasons), tuple(lasting)))
            continue
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
        out.append(Candidate(gpu, available, tuple(reasons)))
    return out


def _used_by(gpu: GPU, pids: set[int]) -> int:
    """GPU memory that the processes ``pids`` hold on ``gpu``."""
    return sum(p.memory or 0 for p in gpu.processes if p.pid in pids)


def _ordered(eligible: list[Candidate], order: str) -> list[Candidate]:
    if order == "free-memory":
        return sorted(eligible, key=lambda c: (-c.available, c.gpu.index))
    if order == "utilization":
        return sorted(eligible, key=lambda c: (c.gpu.utilization or 0.0, -c.available, c.gpu.index))
    if order == "fastest":  # strongest first (capability score), then most free memory
        from devicekit.hardware.capability import capabilities

        scores = {c.gpu.uuid: s.score for c, s in zip(eligible, capabilities([c.gpu for c in eligible]),
                                                      strict=True)}
        return sorted(eligible, key=lambda c: (-scores[c.gpu.uuid], -c.available, c.gpu.index))
    if order == "random":
        import random  # imported here: it costs the CLI's cold start a few ms

        shuffled = list(eligible)
        random.shuffle(shuffled)
        return shuffled
    return sorted(eligible, key=lambda c: c.gpu.index)


#: reservations that lost a race (a device taken between our look and our lock) look again
_RACE_RETRIES = 5


def _attempt(request: _Request, lease: bool, command: str | None, ticket: Any = None
             ) -> tuple[Selection | None, list[Candidate], str]:
    """One snapshot: choose, then lock the chosen devices one by one, or report why not.

    Locks are tried in order of preference without waiting: a device taken by someone else a
    moment earlier is skipped for the next one; when too few can be had, everything taken is
    given back and the choice is made again from a fresh look (a few times), so two requests
    never wait on each other and a partial grant never leaks.
    """
    gpus = inventory.gpus()
    devices = leasable_devices(gpus)
    visible = visible_uuids(gpus)
    note = f"{VISIBLE_ENV}={os.environ.get(VISIBLE_ENV)!r}"
    if not lease:
        held = read_leases()
        candidates = _queue_marks(assess(devices, held, request, visible, note, _holder_pids(held)),
                                  blocked(lease_dir(), devices, held, ticket, request.count))
        candidates = _mark_blocked(candidates)  # never offer what run would refuse
        chosen = _choose(candidates, request)
        return (Selection([c.gpu for c in chosen], _rejected(candidates, chosen, request))
                if chosen else None), candidates, _no_gpu_reason(gpus)
    for attempt in range(_RACE_RETRIES):
        live = read_leases(cleanup=True)
        candidates = assess(devices, live, request, visible, note, _holder_pids(live))
        candidates = _queue_marks(candidates, blocked(lease_dir(), devices, live, ticket, request.count))
        if not _choose(candidates, request):
            return None, candidates, _no_gpu_reason(gpus)
        ordered = _ordered([c for c in candidates if c.eligible], request.order)
        by_uuid = {c.gpu.uuid: c for c in ordered}
        judge = _share_judge(by_uuid, request, visible, note) if request.share else None
        held, refused = Lease.take(list(by_uuid), count=request.count, memory=request.min_free,
                                   share=request.share, command=command, judge=judge)
        candidates = [Candidate(c.gpu, c.available, (refused[c.gpu.uuid],))
                      if c.gpu.uuid in refused else c for c in candidates]
        if held is not None:
            chosen = [by_uuid[uuid] for uuid in held.gpu_uuids]
            return Selection([c.gpu for c in chosen], _rejected(candidates, chosen, request),
                             held), candidates, ""
        import random  # imported here, like below: only a lost race needs it

        time.sleep(random.uniform(0.005, 0.03) * (attempt + 1))
    return None, candidates, ""


def _mark_blocked(candidates: list[Candidate]) -> list[Candidate]:
    """Candidates whose lock file another user made unusable, marked ineligible (squatting)."""
    from devicekit.hardware.lease_directory import lease_dir
    from devicekit.hardware.lock_squatting import blocked_devices

    blocked = blocked_devices(lease_dir(), [c.gpu.uuid for c in candidates if c.eligible])
    return [Candidate(c.gpu, c.available, (blocked[c.gpu.uuid],)) if c.gpu.uuid in blocked else c
            for c in candidates]


def _queue_marks(candidates: list[Candidate], queue: dict[str, str]) -> list[Candidate]:
    """Eligible devices the fair queue keeps from this requester, with why (not lasting)."""
    return [Candidate(c.gpu, c.available, (queue[c.gpu.uuid],), c.lasting)
            if c.gpu.uuid in queue and c.eligible else c for c in candidates]


def _share_judge(by_uuid: dict[str, Candidate], request: _Request, visible: set[str],
                 note: str) -> Any:
    """For a share request: with the device locked, does its budget still fit? (None: yes)."""
    def judge(uuid: str, live: Sequence[LeaseRecord]) -> str | None:
        (fresh,) = assess([by_uuid[uuid].gpu], live, request, visible, note, _holder_pids(live))
        return None if fresh.eligible else "; ".join(fresh.reasons)

    return judge


def _holder_pids(leases: Sequence[LeaseRecord]) -> dict[int, set[int]]:
    """For share leases held on this host: the holder's pid and all its descendants' pids."""
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


def _choose(candidates: list[Candidate], request: _Request) -> list[Candidate]:
    eligible = _ordered([c for c in candidates if c.eligible], request.order)
    if request.count is None:
        return eligible
    return eligible[: request.count] if len(eligible) >= request.count else []


def _rejected(candidates: list[Candidate], chosen: list[Candidate], request: _Request) -> list[str]:
    picked = {c.gpu.uuid for c in chosen}
    lines = []
    for c in candidates:
        if c.gpu.uuid in picked:
            continue
        if c.eligible:
            lines.append(f"{c.gpu.label}: eligible but not needed "
                         f"({request.count} asked, order {request.order})")
        else:
            lines.append(c.line())
    return lines


def _no_gpu_reason(gpus: Sequence[GPU]) -> str:
    if gpus:
        return ""
    reason = getattr(inventory.backend(), "reason", None)
    return f"no GPUs found ({reason})" if reason else "no GPUs found"


def select_gpus(count: int | str = 1, *, min_free_memory: str | int | None = None,
                max_utilization: float | str | None = None,
                exclude: Iterable[int | str] | int | str = (), order: str = "free-memory",
                wait: float | None = None, lease: bool = True, fallback: str | None = None,
                account_as_free: Iterable[str] | str = (), share: bool = False,
                poll_interval: float = 1.0, progress: bool | None = None,
                command: str | None = None, time_limit: float | str | None = None) -> Selection:
    """Choose ``count`` GPUs (``"all"``: every eligible one) and lease them.

    ``min_free_memory``: a size (``"20GiB"``) each GPU must have free; with ``share=True`` it is
    also the memory budget this lease claims, and several share leases may sit on one GPU while
    their budgets fit. ``max_utilization``: percent busy at most. ``exclude``: indices or UUIDs.
    ``order``: ``"free-memory"`` (most first), ``"utilization"`` (idlest first), ``"fastest"``
    (strongest first by :mod:`~devicekit.hardware.capability` score, then most free; the chosen
    GPUs come back in that order, so ``cuda:0`` is the strongest), ``"index"`` or ``"random"``. ``account_as_free``: users whose processes' GPU memory counts as free (your own
    idle notebook). ``wait``: seconds to poll (every ``poll_interval`` s, with a progress line on
    a terminal when ``progress`` is None) for enough GPUs. ``lease=False``: choose without
    reserving (still skips leased GPUs). ``fallback="cpu"``: return a CPU selection instead of
    raising :class:`~devicekit.errors.NoDeviceAvailable`. ``command``: recorded in the lease.
    Waiting takes a ticket in the fair queue (first come, first served; GPUs reserved for the
    head; see :mod:`~devicekit.hardware.queue_order`). ``time_limit`` (``"30m"``): the job's
    declared limit, which lets it be backfilled onto reserved GPUs; ``devicekit run --time``
    enforces it (a caller of ``select_gpus`` promises to release the GPUs by then).
    """
    request = _make_request(count, min_free_memory, max_utilization, exclude, order,
                            account_as_free, share)
    if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float))
                             or not math.isfinite(wait) or wait < 0):
        raise InvalidValueError(f"wait {wait!r} must be a number of seconds >= 0")
    if fallback not in (None, "cpu"):
        raise InvalidValueError(f"fallback {fallback!r} must be None or 'cpu'")
    if isinstance(poll_interval, bool) or not isinstance(poll_interval, (int, float)) \
            or not poll_interval > 0:
        raise InvalidValueError(f"poll_interval {poll_interval!r} must be a number of seconds > 0")
    limit = parse_duration(time_limit, name="time_limit") if time_limit is not None else None
    start = time.monotonic()
    deadline = start + (wait or 0.0)
    display: WaitDisplay | None = None
    ticket = None
    try:
        while True:
            selection, candidates, empty = _attempt(request, lease, command, ticket)
            if selection is not None:
                return queued(selection, ticket, limit, command)
            now = time.monotonic()
            if wait is None or now >= deadline or not _waiting_helps(candidates, request):
                break
            if ticket is None and request.count is not None and not request.share:
                ticket = join_for(request, candidates, command, limit)
            if display is None:
                display = WaitDisplay(request.count, wait, enabled=progress)
            display.update(candidates, deadline - now)
            time.sleep(min(poll_interval, max(deadline - now, 0.0)))
    except BaseException:
        if ticket is not None:
            ticket.close()
        raise
    finally:
        if display is not None:
            display.close()
    if ticket is not None:
        ticket.close()
    error = _shortfall(request, candidates, empty, wait)
    if fallback == "cpu":
        return Selection([], [*error.reasons, f"falling back to cpu: {error.summary}"], None,
                         cpu_fallback=True)
    raise error


def _waiting_helps(candidates: Sequence[Candidate], request: _Request) -> bool:
    """Whether enough GPUs could qualify once busy ones free up (else waiting is pointless)."""
    return sum(c.possible for c in candidates) >= (request.count or 1)


def _shortfall(request: _Request, candidates: Sequence[Candidate], empty: str,
               wait: float | None) -> NoDeviceAvailable:
    """The error for too few GPUs: why, whether waiting could help, and what to do."""
    asked = "at least 1" if request.count is None else str(request.count)
    eligible = sum(c.eligible for c in candidates)
    if not candidates:
        reason = empty or "no GPUs found"
        return NoDeviceAvailable(f"need {asked} GPU(s) but {reason}; waiting cannot help",
                                 [reason], waiting_helps=False)
    if not _waiting_helps(candidates, request):
        possible = sum(c.possible for c in candidates)
        lasting = [f"{c.gpu.label}: {'; '.join(c.lasting)}" for c in candidates if c.lasting]
        if lasting:
            message = (f"need {asked} GPU(s) but only {possible} of the {len(candidates)} GPU(s)"
                       f" here could ever qualify: {'; '.join(lasting)}; waiting cannot help")
        else:
            message = (f"need {asked} GPU(s) but this machine has only {len(candidates)};"
                       " waiting cannot help")
        return NoDeviceAvailable(message, lasting, waiting_helps=False,
                                 hint="ask for fewer GPUs or relax the limits")
    reasons = [c.line() for c in candidates if not c.eligible]
    waited = f" after waiting {wait:g} s" if wait else ""
    message = f"need {asked} GPU(s), {eligible} eligible now{waited}: {'; '.join(reasons)}"
    if wait:
        return NoDeviceAvailable(message, reasons, hint="wait longer or relax the limits")
    return NoDeviceAvailable(
        message, reasons,
        hint="pass wait=SECONDS to queue until they free up, or relax the limits",
        cli_hint="add --wait SECONDS to queue until they free up, or relax the limits")


def _make_request(count: Any, min_free_memory: Any, max_utilization: Any, exclude: Any,
                  order: Any, account_as_free: Any, share: bool) -> _Request:
    n = _check_count(count)
    min_free = (parse_size(min_free_memory, name="min_free_memory")
                if min_free_memory is not None else None)
    max_util = (parse_percent(max_utilization, name="max_utilization")
                if max_utilization is not None else None)
    if order not in ORDERS:
        raise InvalidValueError(f"order {order!r} is not one of {', '.join(ORDERS)}")
    users = [account_as_free] if isinstance(account_as_free, str) else list(account_as_free)
    if not all(isinstance(u, str) and u for u in users):
        raise InvalidValueError(f"account_as_free {account_as_free!r} must be user names")
    if share and min_free is None:
        raise InvalidValueError(
            "share=True needs min_free_memory: the memory budget this job claims on a shared GPU"
        )
    return _Request(n, min_free, max_util, parse_exclude(exclude), order, frozenset(users),
                    bool(share))
