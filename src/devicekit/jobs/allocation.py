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
from devicekit.units import format_size, parse_size

__all__ = ["Allocation", "allocate", "plan_processes", "devices_mode", "positive_count", "DEVICE_MODES",
           "CallerWords", "CLI", "LAUNCH"]


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


@dataclass(frozen=True)
class CallerWords:
    """What the caller calls each knob, so that every error speaks its language: a
    ``devicekit run`` user reads ``--gpus``, a ``dk.launch`` caller ``nprocs``."""

    procs: str
    per_proc: str
    min_free: str
    #: the request for every free GPU: ``--gpus all``, ``launch() without nprocs``
    all_free: str
    #: how to use busy GPUs too ({every}: the indices of all GPUs)
    use_busy: str


CLI = CallerWords("--procs", "--gpus-per-proc", "--min-free", "--gpus all",
                  "name them, --gpus {every}, or set --max-util/--min-free")
LAUNCH = CallerWords("nprocs", "gpus_per_proc", "min_free_memory", "launch() without nprocs",
                     "pass nprocs=N, or devices='visible' to share yours")


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
    words: CallerWords = CLI,
) -> Allocation:
    """Decide the processes and lease their GPUs (choosing them is ``select_gpus``'s).

    ``gpus``: a count, ``"all"`` (every GPU that passes the filters; without filters, every GPU
    no other job uses: :func:`busy_reason`) or None (not asked). ``gpu_ids``: exactly these GPUs
    (indices or UUIDs), rank 0 on the first; all of them must pass the filters or nothing is
    leased. ``exclude``, ``max_utilization``, ``min_free_memory``, ``wait`` and ``time_limit``
    go to :func:`~devicekit.selection.choose.select_gpus`. ``procs``: processes wanted, or None.
    Rules: with GPUs present, ``procs`` processes get ``gpus_per_proc`` GPUs each (default: one
    process, or ``gpus // gpus_per_proc``); with no GPU (or every GPU hidden by
    ``CUDA_VISIBLE_DEVICES``) and ``gpus`` not given, ``procs`` (default 1) CPU processes;
    ``gpus`` given but no GPU usable raises :class:`NoDeviceAvailable` listing why.
    ``command`` is recorded in the lease; ``words`` names the knobs in errors.
    """
    from devicekit.hardware.inventory import backend
    from devicekit.hardware.inventory import gpus as inventory_gpus

    for value, name in ((gpus_per_proc, words.per_proc), (procs, words.procs)):
        if value is not None:
            positive_count(value, name)
    if min_free_memory is not None:  # checked even where there is no GPU to filter
        parse_size(min_free_memory, name=words.min_free)
    gpus = _gpu_count(gpus)
    present = inventory_gpus()
    ids = _gpu_ids(present, gpu_ids, gpus, exclude)
    if ids:
        gpus = len(ids)
    if present and gpus is None and _all_hidden(present):
        # the default is one GPU where there is one, the CPU otherwise: with every GPU hidden
        # (CUDA_VISIBLE_DEVICES=-1 or ""), there is none this job may use
        return _on_cpu(procs, gpus_per_proc, "running on the CPU (WHAT): CUDA_VISIBLE_DEVICES="
                       f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r} hides"
                       f" every GPU ({len(present)} on this machine); unset it or ask --gpus N"
                       " to use them")
    if not present:
        why = getattr(backend(), "reason", None) or "the GPU list is empty"
        if gpus is not None:
            raise NoDeviceAvailable(f"--gpus {gpus} asked but this machine has no GPU ({why});"
                                    " drop --gpus to run on the CPU", [why])
        return _on_cpu(procs, gpus_per_proc,
                       f"no GPU on this machine, running on the CPU (WHAT); why: {why}")
    count = _lease_count(gpus, procs, gpus_per_proc)
    every = ",".join(str(g.index) for g in present)
    busy: list[tuple[Any, str]] = []
    if gpus == "all" and min_free_memory is None and max_utilization is None:
        busy = [(g, why) for g in present if (why := busy_reason(g))]
        if len(busy) == len(present):
            lines = [f"{g.label}: {why}" for g, why in busy]
            raise NoDeviceAvailable(f"{words.all_free}: no GPU is free ({'; '.join(lines)}); to"
                                    f" use busy ones: {words.use_busy.format(every=every)}",
                                    lines, waiting_helps=False)
    selection = _lease(count, gpus_per_proc, {
        "min_free_memory": min_free_memory, "wait": wait, "lease": True, "command": command,
        "max_utilization": max_utilization, "time_limit": time_limit, "gpus": present,
        "exclude": [*exclude, *(g.uuid for g in present if ids and g.uuid not in ids),
                    *(g.uuid for g, _ in busy)]})
    if ids:
        selection.gpus = sorted(selection.gpus, key=lambda g: ids.index(g.uuid))  # as asked
    else:  # rank 0 (cuda:0) on the strongest GPU: on a mixed machine the rank that logs,
        # saves and evaluates is not the slowest
        from devicekit.hardware.capability import strongest_first

        selection.gpus = strongest_first(selection.gpus)
    nprocs = len(selection.gpus) // gpus_per_proc
    names = ", ".join(f"{g.label} ({g.name}, {format_size(g.memory_free)} free)"
                      for g in selection.gpus)
    skipped = [f"{g.label}: {why}; {words.all_free} takes the free GPUs (to use it too:"
               f" {words.use_busy.format(every=every)})" for g, why in busy]
    rejected = [line for line in selection.rejected
                if not any(line.startswith(f"{g.label}:") for g, _ in busy)]
    return Allocation(nprocs, gpus_per_proc, selection,
                      f"leased {names} for {nprocs} process(es) x {gpus_per_proc} GPU(s)",
                      [*skipped, *rejected])


def _gpu_count(gpus: int | str | None) -> int | str | None:
    """``--gpus``: None, ``"all"`` or a count >= 1 (GPU 0 itself is ``--gpus 0,``)."""
    if isinstance(gpus, str):
        if gpus.strip().lower() == "all":
            return "all"
        try:
            gpus = int(gpus)
        except ValueError:
            raise InvalidValueError(f"--gpus {gpus!r} must be a number or 'all'") from None
    if gpus == 0:
        raise InvalidValueError(
            "--gpus 0 asks for no GPU: drop --gpus to run on the CPU; for GPU 0 itself write"
            " --gpus 0, (a list of one) or --gpu-ids 0")
    return gpus if gpus is None else positive_count(gpus, "gpus")


def _gpu_ids(present: Sequence[Any], gpu_ids: Sequence[str | int] | None,
             gpus: int | str | None, exclude: Sequence[str | int]) -> list[str]:
    """UUIDs of the GPUs named by index or UUID (prefix), in order; none named: ``[]``."""
    if not gpu_ids:
        return []
    named = ",".join(map(str, gpu_ids))
    if gpus is not None:
        raise InvalidValueError(f"GPU ids {named} and --gpus {gpus} both say which GPUs; give one")
    if not present:
        from devicekit.hardware.inventory import backend

        raise NoDeviceAvailable(f"GPUs {named} asked but this machine has no GPU; drop them to"
                                " run on the CPU", [getattr(backend(), "reason", "no GPU found")])
    from devicekit.selection.exclude import excluded, parse_exclude

    uuids: list[str] = []
    for entry in gpu_ids:
        (uuid,) = excluded(present, parse_exclude(str(entry).strip() or "?"), what="GPU")
        if uuid in uuids:
            raise InvalidValueError(f"GPU {str(entry).strip()!r} is named twice")
        uuids.append(uuid)
    clash = excluded(present, parse_exclude(exclude)) & set(uuids) if exclude else set()
    if clash:
        index = next(g.index for g in present if g.uuid in clash)
        raise InvalidValueError(f"GPU {index} is both asked for and excluded; drop it from one"
                                " of the lists")
    return uuids


def _lease_count(gpus: int | str | None, procs: int | None, per_proc: int) -> int | None:
    """How many GPUs to lease (None: every free one), checking that the counts agree."""
    if gpus == "all":
        if procs is not None:
            raise InvalidValueError(
                f"--gpus all starts one process per --gpus-per-proc GPUs itself; --procs {procs}"
                " would be ignored: drop it, or give --gpus N")
        return None
    if gpus is None:
        return (procs or 1) * per_proc
    if gpus % per_proc:  # type: ignore[operator]
        raise InvalidValueError(f"--gpus {gpus} is not a multiple of --gpus-per-proc {per_proc}")
    if procs is not None and procs * per_proc != gpus:
        raise InvalidValueError(
            f"--procs {procs} x --gpus-per-proc {per_proc} does not match --gpus {gpus}; give"
            f" --procs that divides {gpus} (each process then drives --gpus/--procs GPUs), or"
            " only one of --gpus and --procs")
    return gpus  # type: ignore[return-value]


def _on_cpu(procs: int | None, per_proc: int, reason: str) -> Allocation:
    """``procs`` (default 1) CPU processes; ``reason`` says why, its WHAT how many."""
    count = procs or 1
    what = "1 process" if count == 1 else f"{count} processes with gloo"
    return Allocation(count, per_proc, None, reason.replace("WHAT", what, 1))


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
            return allocate(None, nprocs, gpus_per_proc=gpus_per_proc,
                            min_free_memory=min_free_memory, words=LAUNCH)
        gpus: int | str = "all" if nprocs is None else positive_count(nprocs) * gpus_per_proc
        return allocate(gpus, None, gpus_per_proc=gpus_per_proc, min_free_memory=min_free_memory,
                        words=LAUNCH)
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
