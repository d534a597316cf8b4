"""Explain an out-of-memory error in plain words: asked vs free, who else holds the GPU,
which tensors are biggest, and the fixes ranked by how likely each is to help.

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
        if self.other_processes:
            lines.append("  other processes on this device:")
            for p in self.other_processes:
                who = "".join(f" {x}" for x in (p.user and f"({p.user})", p.command) if x)
                lines.append(f"    pid {p.pid}{who}: {s(p.memory)}")
        if self.holders:
            lines.append("  biggest tensors:")
            for h in self.holders:
                where = f" [{h.where}]" if h.where else ""
                lines.append(f"    {format_size(h.bytes):>10}  {h.name} ({h.category}, {h.dtype} {list(h.shape)}){where}")
        lines.append("  what to do, most likely to help first:")
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
    fixes = _rank_fixes(diag_facts, others, holders)
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


def _rank_fixes(f: OOMFacts, others: list[GPUProcess], holders: list[CensusEntry]) -> list[str]:
    ranked: list[tuple[float, str]] = []
    limit = f.allowed or f.total
    asked = f.requested or 0
    if f.backend == "cpu":
        ranked.append((1, "host RAM is exhausted: lower the batch size, load data lazily (a Dataset that "
                          "reads per item, memory-mapped files) and del large intermediate tensors"))
    if asked and limit and asked > limit:
        ranked.append((0, f"one allocation of {format_size(asked)} is larger than the device allows "
                          f"({format_size(limit)}): shrink that tensor (batch size, sequence length, "
                          f"image size) or shard it across devices"))
    other_bytes = sum(p.memory or 0 for p in others)
    if others and f.total and other_bytes > 0.1 * f.total:
        names = ", ".join(f"pid {p.pid}" + (f" ({p.user})" if p.user else "") for p in others[:3])
        ranked.append((0.5, f"other processes hold {format_size(other_bytes)} of this GPU ({names}): "
                            f"pick a free GPU (`devicekit select`) or wait for them"))
    if f.reserved_unused and (f.reserved_unused >= asked or
                              (f.allocated and f.reserved_unused > 0.2 * f.allocated)):
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        advice = ("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting"
                  if "expandable_segments:True" not in conf else
                  "expandable_segments is already on: call dk.empty_cache() between phases")
        ranked.append((0.8, f"{format_size(f.reserved_unused)} is reserved by PyTorch but unused "
                            f"(fragmentation): {advice}"))
    if f.allowed and f.total and f.allowed < f.total:
        ranked.append((0.9, f"a memory fraction limit of {format_size(f.allowed)} is set "
                            f"(torch.cuda.set_per_process_memory_fraction): raise it if this was not meant"))
    loose = [h for h in holders if h.category not in ("parameter", "buffer", "gradient", "optimizer state")]
    if loose and loose[0].bytes >= 0.05 * max(f.allocated or 0, 1):
        h = loose[0]
        ranked.append((2, f"`{h.name}` holds {format_size(h.bytes)}: `del` it (or move it to CPU) once used; "
                          f"run dk.find_leaks if it grows every step"))
    state = sum(h.bytes for h in holders if h.category == "optimizer state")
    params = sum(h.bytes for h in holders if h.category == "parameter")
    if state and state >= params:
        ranked.append((4, "optimizer state outweighs the weights (Adam keeps two copies): a lighter "
                          "optimizer (SGD, Adafactor) or an 8-bit optimizer saves most of it"))
    if f.backend != "cpu":
        ranked.append((3, "halve the batch size, or let dk.find_batch_size find the largest that fits "
                          "(keep the effective batch with gradient accumulation)"))
        ranked.append((3.5, "use mixed precision (torch.autocast with bfloat16) to halve activations; "
                            "gradient checkpointing (torch.utils.checkpoint) trades compute for memory"))
        ranked.append((5, "for evaluation, run under torch.no_grad() or torch.inference_mode() so no "
                          "activations are kept"))
    ranked.sort(key=lambda pair: pair[0])
    return [text for _, text in ranked]
