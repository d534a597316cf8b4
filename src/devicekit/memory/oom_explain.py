"""Explain an out-of-memory error in plain words: asked vs free, who else holds the GPU,
which tensors are biggest, and the fixes ranked by how much memory each could recover (those
that could not recover a meaningful share of the shortfall are left out). One allocation larger
than the whole device (host RAM for the CPU) gets one plain answer instead.

Figures come from the error message first (torch writes them at the moment of failure), then
from the CUDA OOM observer's capture (:mod:`devicekit.memory.oom`), then from a usage snapshot
taken now. Other processes on the GPU come from the hardware inventory (NVML or simulated).

Usage::

    from devicekit.memory.oom_explain import explain

    try:
        train()
    except torch.OutOfMemoryError as exc:
        print(explain(exc))       # OOMDiagnosis; .fixes is the ranked list
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from devicekit.errors import DeviceKitError
from devicekit.hardware.gpu import GPU, GPUProcess
from devicekit.hardware.visible import visible_devices
from devicekit.memory.census import CensusEntry, census
from devicekit.memory.oom_message import OOMFacts, parse_oom
from devicekit.memory.usage import DeviceMemory
from devicekit.units import format_size

__all__ = ["OOMDiagnosis", "explain"]


@dataclass(frozen=True)
class OOMDiagnosis:
    """Everything :func:`explain` found; ``text()`` is what the guard prints."""

    backend: str
    device: str
    requested: int | None
    free: int | None
    total: int | None
    allowed: int | None
    allocated: int | None
    reserved_unused: int | None
    other_processes: list[GPUProcess]
    holders: list[CensusEntry]
    fixes: list[str]
    source: str  # where the figures came from
    error: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        s = _size
        lines = [f"devicekit: out of memory on {self.device}"]
        lines.append(f"  asked for:    {s(self.requested)}")
        limit = f" (limit {s(self.allowed)} set by set_per_process_memory_fraction)" if self.allowed else ""
        lines.append(f"  free:         {s(self.free)} of {s(self.total)}{limit}")
        if self.backend != "cpu":
            lines.append(f"  PyTorch:      {s(self.allocated)} in tensors, {s(self.reserved_unused)} "
                         f"reserved but unused (fragmentation/cache)")
        too_big = larger_than_device(self.requested, self.total)  # then only the plain answer matters
        if self.other_processes and not too_big:
            lines.append("  other processes on this device:")
            for p in self.other_processes:
                who = "".join(f" {x}" for x in (p.user and f"({p.user})", p.command) if x)
                lines.append(f"    pid {p.pid}{who}: {s(p.memory)}")
        if self.holders and not too_big:
            lines.append("  biggest tensors:")
            for h in self.holders:
                where = f" [{h.where}]" if h.where else ""
                lines.append(f"    {format_size(h.bytes):>10}  {h.name} ({h.category}, {h.dtype} {list(h.shape)}){where}")
        lines.append("  what to do, most memory recovered first:")
        lines.extend(f"    {i}. {fix}" for i, fix in enumerate(self.fixes, 1))
        lines.append(f"  (figures: {self.source})")
        return "\n".join(lines)

    __str__ = text


def _size(value: int | None) -> str:
    return "unknown" if value is None else format_size(value)


def explain(
    exc: BaseException, *, usage: list[DeviceMemory] | None = None, gpus: list[GPU] | None = None,
    frames: Iterable[types.FrameType] = (), top: int = 5, observed: dict[str, Any] | None = None,
) -> OOMDiagnosis:
    """Diagnose ``exc``. ``usage``/``gpus``/``observed`` replace live measurements (tests, replays)."""
    facts = parse_oom(str(exc))
    backend = facts.backend if facts.backend != "unknown" else ("cpu" if isinstance(exc, MemoryError) else "cuda")
    index = facts.device if facts.device is not None else (observed or {}).get("device", 0)
    device = "cpu" if backend == "cpu" else f"{backend}:{index}"
    sources = ["the error message"]
    requested, free, total = facts.requested, facts.free, facts.total
    allocated, unused = facts.allocated, facts.reserved_unused
    if observed and observed.get("device") == index and backend == "cuda" and _same_request(facts, observed):
        sources.append("the allocator at the moment of failure")
        requested = requested if requested is not None else observed.get("requested")
        free = free if free is not None else observed.get("free")
        total = total if total is not None else observed.get("limit")
        allocated = allocated if allocated is not None else observed.get("allocated")
        if unused is None and observed.get("reserved") is not None and observed.get("allocated") is not None:
            unused = observed["reserved"] - observed["allocated"]
    listing = census(top=top, device=device, frames=frames)
    holders = [e for e in listing.by_name if e.bytes]
    if backend == "cpu" and allocated is None:
        allocated = listing.by_device.get("cpu")
    row = _usage_row(device, usage)
    if row is not None:
        sources.append("a usage snapshot taken after the failure")
        free = free if free is not None else row.free
        total = total if total is not None else row.total
        allocated = allocated if allocated is not None else row.allocated
        unused = unused if unused is not None else row.reserved_unused
    others = _other_processes(facts, index, gpus) if backend == "cuda" else []
    diag_facts = OOMFacts(backend, requested, index, total, free, facts.allowed, None, allocated, unused)
    fixes = _rank_fixes(diag_facts, device, others, holders, listing.by_category)
    return OOMDiagnosis(backend, device, requested, free, total, facts.allowed, allocated, unused, others,
                        holders, fixes, ", then ".join(sources), error=str(exc).split("\n")[0][:300])


def _same_request(facts: OOMFacts, observed: dict[str, Any]) -> bool:
    """Whether the observer's capture is of this failure: the allocator's message states the
    size it could not allocate (to 2 decimals), the observer the exact size. A capture from an
    earlier failure (a batch-size trial, a caught OOM) must not explain a later error."""
    asked = observed.get("requested")
    if facts.requested is None or not isinstance(asked, int):
        return False
    return abs(facts.requested - asked) <= max(0.01 * asked, 1)


def _usage_row(device: str, usage: list[DeviceMemory] | None) -> DeviceMemory | None:
    if usage is None:
        from devicekit.memory.usage import cpu_usage
        from devicekit.memory.usage import usage as measure

        try:  # CPU tensors were just counted by the census: no second walk
            usage = [cpu_usage(count_tensors=False)] if device == "cpu" else measure(device)
        except Exception:  # the device may be gone or broken after the failure
            return None
    return next((row for row in usage if row.device == device), None)


def _other_processes(facts: OOMFacts, index: int, gpus: list[GPU] | None) -> list[GPUProcess]:
    if gpus is None:
        try:
            from devicekit.hardware.inventory import gpus as inventory

            gpus = inventory()
        except Exception:  # NVML trouble must not hide the diagnosis
            gpus = []
    try:  # cuda:<index> in this process -> the physical GPU (CUDA_VISIBLE_DEVICES applied)
        visible = visible_devices(gpus)
        gpu = visible[index].gpu if index < len(visible) else None
    except DeviceKitError:  # a bad CUDA_VISIBLE_DEVICES must not hide the diagnosis
        gpu = None
    found: dict[int, GPUProcess] = {}
    for proc in gpu.processes if gpu is not None else ():
        if proc.pid != os.getpid():
            found[proc.pid] = proc
    for pid, size in facts.processes:
        if pid != os.getpid() and pid not in found:
            found[pid] = GPUProcess(pid, memory=size)
    return sorted(found.values(), key=lambda p: -(p.memory or 0))


#: a measured fix is offered only if it could recover at least this share of the shortfall
MEANINGFUL_SHARE = 0.25


@dataclass(frozen=True)
class _Fix:
    text: str
    recovers: int  # bytes this fix could make available


def larger_than_device(requested: int | None, total: int | None) -> bool:
    """Whether one allocation exceeds the device's whole memory (host RAM for the CPU): then no
    amount of freeing helps, and every other fix is noise."""
    return requested is not None and total is not None and requested > total


def _rank_fixes(f: OOMFacts, device: str, others: list[GPUProcess], holders: list[CensusEntry],
                by_category: dict[str, int]) -> list[str]:
    """Fixes that free memory, ranked by the bytes each could recover; those that could not
    recover a meaningful share of the shortfall are left out. Advice whose effect cannot be
    measured here (batch size, precision) follows."""
    if larger_than_device(f.requested, f.total):
        return [_too_big(f, device)]
    shortfall = _shortfall(f)
    measured = [fix for fix in _measured_fixes(f, others, holders, by_category)
                if shortfall is None or fix.recovers >= MEANINGFUL_SHARE * shortfall]
    measured.sort(key=lambda fix: -fix.recovers)
    return [fix.text for fix in measured] + _general_fixes(f, shortfall)


def _shortfall(f: OOMFacts) -> int | None:
    """Bytes missing for the failed request: asked minus free, or all of it when free is unknown
    or looks sufficient (fragmentation, a fraction limit)."""
    if f.requested is None:
        return None
    if f.free is not None and f.free < f.requested:
        return f.requested - f.free
    return f.requested


def _too_big(f: OOMFacts, device: str) -> str:
    whole = "all of host RAM" if f.backend == "cpu" else f"the whole of {device}"
    return (f"one allocation of {_size(f.requested)} is larger than {whole} ({_size(f.total)}): freeing "
            f"memory cannot make it fit. Make that tensor smaller (a smaller batch or shape; "
            f"dk.find_batch_size finds the largest batch that fits), split or shard it across devices "
            f"(dk.split), or store it in lower precision (bfloat16 takes half of float32)")


def _measured_fixes(f: OOMFacts, others: list[GPUProcess], holders: list[CensusEntry],
                    by_category: dict[str, int]) -> list[_Fix]:
    fixes: list[_Fix] = []
    other_bytes = sum(p.memory or 0 for p in others)
    if other_bytes:
        names = ", ".join(f"pid {p.pid}" + (f" ({p.user})" if p.user else "") for p in others[:3])
        fixes.append(_Fix(f"other processes hold {format_size(other_bytes)} of this GPU ({names}): "
                          f"pick a free GPU (`devicekit select`) or wait for them", other_bytes))
    if f.reserved_unused:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        advice = ("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting"
                  if "expandable_segments:True" not in conf else
                  "expandable_segments is already on: call dk.empty_cache() between phases")
        fixes.append(_Fix(f"{format_size(f.reserved_unused)} is reserved by PyTorch but unused "
                          f"(fragmentation): {advice}", f.reserved_unused))
    if f.allowed and f.total and f.allowed < f.total:
        fixes.append(_Fix(f"a memory fraction limit of {format_size(f.allowed)} is set "
                          f"(torch.cuda.set_per_process_memory_fraction): raise it if this was not meant",
                          f.total - f.allowed))
    loose = [h for h in holders if h.category not in ("parameter", "buffer", "gradient", "optimizer state")]
    if loose:
        h = loose[0]
        fixes.append(_Fix(f"`{h.name}` holds {format_size(h.bytes)}: `del` it (or move it to CPU) once used; "
                          f"run dk.find_leaks if it grows every step", h.bytes))
    state = by_category.get("optimizer state", 0)
    if state and state >= by_category.get("parameter", 0):
        fixes.append(_Fix(f"optimizer state holds {format_size(state)}, more than the weights (Adam keeps "
                          f"two copies): a lighter optimizer (SGD, Adafactor) or an 8-bit optimizer saves "
                          f"most of it", state))
    return fixes


def _general_fixes(f: OOMFacts, shortfall: int | None) -> list[str]:
    if f.backend == "cpu":
        short = f"host RAM is {format_size(shortfall)} short" if shortfall else "host RAM ran out"
        return [f"{short}: lower the batch size, load data lazily (a Dataset that reads per item, "
                "memory-mapped files) and del large intermediate tensors"]
    return ["halve the batch size, or let dk.find_batch_size find the largest that fits "
            "(keep the effective batch with gradient accumulation)",
            "use mixed precision (torch.autocast with bfloat16) to halve activations; "
            "gradient checkpointing (torch.utils.checkpoint) trades compute for memory",
            "for evaluation, run under torch.no_grad() or torch.inference_mode() so no "
            "activations are kept"]
