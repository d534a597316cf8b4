"""How many processes to start and which leased GPUs each one gets (for ``launch`` and ``run``).

GPUs are chosen and leased in one step by ``devicekit.selection.choose.select_gpus``; this
module only decides the count and splits the selection into per-process groups. Where there
are no GPUs and none were asked for explicitly, processes run on the CPU (gloo).
``plan_processes`` adds ``dk.launch``'s ``devices=`` modes: ``"cpu"`` (CPU ranks, nothing
leased, even on a GPU machine) and ``"visible"`` (ranks share the caller's GPUs, nothing leased).

Usage::

    from devicekit.jobs.allocation import allocate

    plan = allocate(gpus="all", gpus_per_proc=1)
    print(plan.nprocs, plan.reason)
    for rank in range(plan.nprocs):
        print(rank, plan.visible_devices(rank))
    plan.release()

    plan_processes("cpu", nprocs=2).reason   # "devices='cpu': 2 CPU process(es) with gloo, ..."
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from devicekit.errors import DeviceKitError, InvalidValueError, NoDeviceAvailable
from devicekit.units import parse_size

__all__ = ["Allocation", "allocate", "plan_processes", "devices_mode", "positive_count", "DEVICE_MODES"]


@dataclass
class Allocation:
    """The outcome: ``nprocs`` processes, on leased GPUs (``selection``) or on the CPU."""

    nprocs: int
    gpus_per_proc: int
    #: the leased selection, None when the processes run on the CPU
    selection: Any = None
    #: one line saying what was chosen and why
    reason: str = ""
    #: lines explaining GPUs that were not chosen
    rejected: list[str] = field(default_factory=list)

    @property
    def on_gpu(self) -> bool:
        return self.selection is not None

    @property
    def uuids(self) -> list[str]:
        """Every leased GPU's UUID, in selection order."""
        return [g.uuid for g in self.selection.gpus] if self.selection is not None else []

    @property
    def cuda_visible_devices(self) -> str:
        """The value for CUDA_VISIBLE_DEVICES covering every process on this node ("" on CPU)."""
        return ",".join(self.uuids)

    def visible_devices(self, rank: int) -> str:
        """CUDA_VISIBLE_DEVICES for local process ``rank`` alone: its own GPU(s)."""
        start = rank * self.gpus_per_proc
        return ",".join(self.uuids[start : start + self.gpus_per_proc])

    @property
    def lease_fds(self) -> list[int]:
        """File descriptors that hold the leases; a child that inherits them keeps them held."""
        if self.selection is None:
            return []
        lease = getattr(self.selection, "lease", None)
        return list(getattr(lease, "fds", None) or [])

    def release(self) -> None:
        """Free the leases (idempotent; nothing to do on the CPU)."""
        if self.selection is not None:
            self.selection.release()


def _positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidValueError(f"{name}={value!r} must be a positive integer")


def allocate(
    gpus: int | str | None = None,
    procs: int | None = None,
    *,
    gpus_per_proc: int = 1,
    min_free_memory: int | str | None = None,
    wait: float | None = None,
    command: str | None = None,
    gpu_ids: Sequence[str | int] | None = None,
    exclude: Sequence[str | int] = (),
    max_utilization: float | str | None = None,
    time_limit: float | None = None,
) -> Allocation:
    """Decide the processes and lease their GPUs.

    ``gpus``: a count, ``"all"`` (every GPU that passes the filters) or None (not asked).
    ``gpu_ids``: exactly these GPUs (indices or UUIDs), rank 0 on the first; all of them must
    pass the filters or nothing is leased. ``exclude`` and ``max_utilization`` filter as in
    :func:`~devicekit.selection.choose.select_gpus`; ``time_limit`` (seconds) is the job's
    declared limit, for the queue's backfill.
    ``procs``: processes wanted, or None. Rules: with GPUs present, ``procs`` processes get
    ``gpus_per_proc`` GPUs each (default: one process, or ``gpus // gpus_per_proc``); with no
    GPU and ``gpus`` not given, ``procs`` (default 1) CPU processes; ``gpus`` given but no GPU
    usable raises :class:`NoDeviceAvailable` listing why. ``command`` is recorded in the lease.
    """
    from devicekit.hardware.inventory import backend
    from devicekit.hardware.inventory import gpus as inventory_gpus

    _positive("gpus_per_proc", gpus_per_proc)
    _positive("procs", procs)
    if min_free_memory is not None:  # checked even where there is no GPU to filter
        parse_size(min_free_memory, name="--min-free")
    if isinstance(gpus, str):
        if gpus.strip().lower() != "all":
            try:
                gpus = int(gpus)
            except ValueError:
                raise InvalidValueError(f"--gpus {gpus!r} must be a number or 'all'") from None
        else:
            gpus = "all"
    if gpus == 0:
        raise InvalidValueError(
            "--gpus 0 asks for no GPU: drop --gpus to run on the CPU; for GPU 0 itself write"
            " --gpus 0, (a list of one) or --gpu-ids 0")
    if gpus != "all":
        _positive("gpus", gpus)  # type: ignore[arg-type]
    present = inventory_gpus()
    ids: list[str] = []
    if gpu_ids:
        if gpus is not None:
            raise InvalidValueError(f"GPU ids {','.join(map(str, gpu_ids))} and --gpus {gpus} both"
                                    " say which GPUs; give one")
        if not present:
            raise NoDeviceAvailable(
                f"GPUs {','.join(map(str, gpu_ids))} asked but this machine has no GPU; drop them to"
                " run on the CPU", [getattr(backend(), "reason", "no GPU found")])
        ids = _resolve_ids(present, gpu_ids)
        gpus = len(ids)
    if present and gpus is None and not ids and _all_hidden(present):
        # the default is one GPU where there is one, the CPU otherwise: with every GPU hidden
        # (CUDA_VISIBLE_DEVICES=-1 or ""), there is none this job may use
        raw = os.environ.get("CUDA_VISIBLE_DEVICES")
        count = procs or 1
        what = "1 process" if count == 1 else f"{count} processes with gloo"
        return Allocation(count, gpus_per_proc, None,
                          f"running on the CPU ({what}): CUDA_VISIBLE_DEVICES={raw!r} hides every"
                          f" GPU ({len(present)} on this machine); unset it or ask --gpus N to use them")
    if not present:
        if gpus is not None:
            why = getattr(backend(), "reason", "no GPU found")
            raise NoDeviceAvailable(
                f"--gpus {gpus} asked but this machine has no GPU ({why}); drop --gpus to run on"
                " the CPU",
                [why],
            )
        why = getattr(backend(), "reason", None) or "the GPU list is empty"
        count = procs or 1
        what = "1 process" if count == 1 else f"{count} processes with gloo"
        return Allocation(count, gpus_per_proc, None,
                          f"no GPU on this machine, running on the CPU ({what}); why: {why}")

    if gpus == "all":
        if procs is not None:
            raise InvalidValueError(
                f"--gpus all starts one process per --gpus-per-proc GPUs itself; --procs {procs}"
                " would be ignored: drop it, or give --gpus N"
            )
        count = None
    elif gpus is not None:
        if gpus % gpus_per_proc:
            raise InvalidValueError(
                f"--gpus {gpus} is not a multiple of --gpus-per-proc {gpus_per_proc}"
            )
        if procs is not None and procs * gpus_per_proc != gpus:
            raise InvalidValueError(
                f"--procs {procs} x --gpus-per-proc {gpus_per_proc} does not match --gpus {gpus};"
                f" give --procs that divides {gpus} (each process then drives --gpus/--procs GPUs),"
                " or only one of --gpus and --procs"
            )
        count = gpus
    else:
        count = (procs or 1) * gpus_per_proc
    busy: list[tuple[Any, str]] = []
    if gpus == "all" and min_free_memory is None and max_utilization is None:
        busy = [(g, why) for g in present if (why := busy_reason(g))]
        if len(busy) == len(present):
            lines = [f"{g.label}: {why}" for g, why in busy]
            raise NoDeviceAvailable(
                f"--gpus all: no GPU is free ({'; '.join(lines)}); name the ones to share"
                f" (--gpus {','.join(str(g.index) for g in present)}) or set --max-util/--min-free",
                lines, waiting_helps=False)
    filters = {"min_free_memory": min_free_memory, "wait": wait, "lease": True, "command": command,
               "max_utilization": max_utilization, "time_limit": time_limit, "gpus": present,
               "exclude": [*exclude, *(g.uuid for g in present if ids and g.uuid not in ids),
                           *(g.uuid for g, _ in busy)]}
    if ids:
        named = [p.strip() for e in exclude for p in str(e).split(",") if p.strip()]
        clash = [e for e in named if _resolve_ids(present, [e])[0] in ids]
        if clash:
            raise InvalidValueError(f"GPU {clash[0]!r} is both asked for and excluded; drop it"
                                    " from one of the lists")
        selection = _lease(count, gpus_per_proc, filters)
        selection.gpus = sorted(selection.gpus, key=lambda g: ids.index(g.uuid))  # as asked
    else:
        selection = _strongest_first(_lease(count, gpus_per_proc, filters))
    chosen = len(selection.gpus)
    nprocs = chosen // gpus_per_proc
    names = ", ".join(f"{g.label} ({g.name}, {_free(g)} free)" for g in selection.gpus)
    reason = f"leased {names} for {nprocs} process(es) x {gpus_per_proc} GPU(s)"
    every = ",".join(str(g.index) for g in present)
    skipped = [f"{g.label}: {why}; --gpus all takes the free GPUs (to use it too, name them:"
               f" --gpus {every})" for g, why in busy]
    rejected = [line for line in selection.rejected
                if not any(line.startswith(f"{g.label}:") for g, _ in busy)]
    return Allocation(nprocs, gpus_per_proc, selection, reason, [*skipped, *rejected])


#: ``launch(devices=...)``: lease GPUs (CPU without any) / CPU ranks, GPUs hidden / see every
#: GPU of the caller, nothing leased
DEVICE_MODES = ("auto", "cpu", "visible")


def devices_mode(devices: Any, gpus_per_proc: int = 1, min_free_memory: Any = None) -> str:
    """``devices`` checked and normalised to one of :data:`DEVICE_MODES`."""
    mode = devices.strip().lower() if isinstance(devices, str) else devices
    if mode not in DEVICE_MODES:
        raise InvalidValueError(f"devices={devices!r} must be one of 'auto', 'cpu' or 'visible'")
    if mode != "auto" and min_free_memory is not None:
        raise InvalidValueError(
            f"min_free_memory={min_free_memory!r} filters the GPUs to lease but devices={mode!r}"
            " leases none; drop it or use devices='auto'"
        )
    if mode == "cpu" and gpus_per_proc != 1:
        raise InvalidValueError(
            f"gpus_per_proc={gpus_per_proc!r} with devices='cpu', which gives the ranks no GPU;"
            " drop it or use devices='auto'"
        )
    return mode


def plan_processes(devices: str, nprocs: int | None, gpus_per_proc: int = 1,
                   min_free_memory: int | str | None = None) -> Allocation:
    """How many ranks ``launch(devices=...)`` starts and the GPUs it leases for them (if any)."""
    from devicekit.hardware.inventory import gpus as inventory_gpus

    if devices == "auto":
        if not inventory_gpus():
            return allocate(None, nprocs, gpus_per_proc=gpus_per_proc)
        gpus: int | str = "all" if nprocs is None else positive_count(nprocs) * gpus_per_proc
        return allocate(gpus, None, gpus_per_proc=gpus_per_proc, min_free_memory=min_free_memory)
    if devices == "cpu":
        count = positive_count(nprocs if nprocs is not None else 1)
        return Allocation(count, 1, None,
                          f"devices='cpu': {count} CPU process(es) with gloo, GPUs hidden")
    from devicekit.hardware.visible import visible_devices

    visible = len(visible_devices()) if inventory_gpus() else 0
    per_proc = positive_count(gpus_per_proc, "gpus_per_proc")
    count = positive_count(nprocs) if nprocs is not None else max(1, visible // per_proc)
    return Allocation(count, per_proc, None,
                      f"devices='visible': {count} process(es) sharing the {visible} visible"
                      " GPU(s), none leased")


def positive_count(value: Any, name: str = "procs") -> int:
    """``value`` if it is a positive integer; otherwise a one-line error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidValueError(f"{name}={value!r} must be a positive integer")
    return value


def _resolve_ids(present: Sequence[Any], ids: Sequence[str | int]) -> list[str]:
    """UUIDs of the GPUs named by index or (a prefix of) UUID; one-line errors for typos."""
    uuids: list[str] = []
    for raw in ids:
        entry = str(raw).strip()
        if entry.isdigit():
            found = [g for g in present if g.index == int(entry)]
        else:
            found = [g for g in present if entry and g.uuid.lower().startswith(entry.lower())]
        if len(found) != 1:
            why = "matches several GPUs" if found else "matches no GPU"
            raise InvalidValueError(
                f"GPU {entry!r} {why}; use an index or UUID from 'devicekit status'")
        if found[0].uuid in uuids:
            raise InvalidValueError(f"GPU {entry!r} is named twice")
        uuids.append(found[0].uuid)
    return uuids


def _lease(count: int | None, per_proc: int, kwargs: dict[str, Any]) -> Any:
    """Lease the GPUs (``count`` of them, or every eligible one rounded to whole processes)."""
    from devicekit.selection import select_gpus

    if count is not None:
        return select_gpus(count, **kwargs)
    # "all": every GPU that passes the filters, rounded down to whole processes
    selection = select_gpus("all", **kwargs)
    usable = len(selection.gpus) - len(selection.gpus) % per_proc
    if usable == len(selection.gpus):
        return selection
    selection.release()
    return select_gpus(max(usable, per_proc), **kwargs)


#: ``--gpus all`` takes the GPUs that are free: at most this share of memory used by others
#: (an idle notebook's context leaves a GPU usable) ...
BUSY_MEMORY_SHARE = 0.25
#: ... and at most this utilization in percent (another job's compute slows every step of a DDP
#: job, which runs at its slowest rank's pace); ``--min-free``/``--max-util`` replace both
BUSY_UTILIZATION = 10.0


def busy_reason(gpu: Any) -> str | None:
    """Why ``gpu`` is not free for ``--gpus all`` (another job's load or memory), or None."""
    from devicekit.units import format_size

    used_share = gpu.memory_used / gpu.memory_total if gpu.memory_total else 0.0
    util = gpu.utilization
    if used_share <= BUSY_MEMORY_SHARE and (util is None or util <= BUSY_UTILIZATION):
        return None
    load = f"{util:g}% busy, " if util is not None else ""
    return f"in use by another job ({load}{format_size(gpu.memory_used)} of" \
           f" {format_size(gpu.memory_total)} used)"


def _all_hidden(present: Sequence[Any]) -> bool:
    """CUDA_VISIBLE_DEVICES is set and shows none of the GPUs (``-1``, ``""``, ``none``)."""
    from devicekit.hardware.visible import visible_devices

    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        return False
    try:
        return not visible_devices(present, warn=False)
    except DeviceKitError:  # a malformed value: select_gpus names it in one line
        return False


def _strongest_first(selection: Any) -> Any:
    """Rank 0 (and ``cuda:0``) gets the strongest GPU, so on a mixed machine the rank that logs,
    saves and evaluates is not the slowest."""
    from devicekit.hardware.capability import strongest_first

    selection.gpus = strongest_first(selection.gpus)
    return selection


def _free(gpu: Any) -> str:
    from devicekit.units import format_size

    return format_size(gpu.memory_free)
