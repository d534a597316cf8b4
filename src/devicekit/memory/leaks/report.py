"""What the leak finder found: :class:`Leak` (one holder) and :class:`LeakReport` (all of them).

Usage::

    report = dk.find_leaks(train_step)
    print(report)                       # one block per leak: holder, line, rate, fix
    for leak in report.leaks:
        print(leak.holder, leak.kind, f"{leak.filename}:{leak.lineno}", leak.bytes_per_step, leak.fix)
    report.to_json()                    # the same, machine-readable
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from devicekit.units import format_size

__all__ = ["Leak", "LeakReport", "KINDS", "coverage_notes"]

#: kind -> what it means, for people
KINDS = {
    "autograd_graph": "autograd graph kept alive",
    "growing_container": "growing container",
    "module_cache": "tensors cached on a module",
    "reference_cycle": "reference cycle holding tensors",
    "growing_tensor": "tensor that keeps growing",
    "hook_per_step": "hooks added every step",
    "lru_cache": "lru_cache keeps every result",
    "deferred_closure": "functions keep tensors they captured",
    "exception_frames": "exceptions keep their frames",
    "tensor_attributes": "tensors linked through tensor attributes",
    "suspended_frames": "suspended generators keep their frames",
    "numpy_views": "numpy arrays keep torch storage alive",
    "unnamed": "tensors that survive every step, no holder found",
    "param_groups": "param groups added every step",
    "buffer_per_step": "buffers registered every step",
    "class_attribute": "class attribute grows",
    "attr_per_step": "attributes added under new names every step",
    "module_per_step": "submodules added every step",
}

#: steps the projection in reports speaks of ("+526 KiB/step = 5 GiB after 10,000 steps")
PROJECTION_STEPS = 10_000


@dataclass(frozen=True)
class Leak:
    """One holder whose memory keeps growing after warm-up.

    ``lineno`` is the line that last extended the holder in the steps traced (the tracer follows
    a holder that grew until it has its line, three steps at most); ``0`` (and ``filename``
    ``""``) only when line attribution was off or could not run, which ``LeakReport.notes``
    then says. ``cleared_at``: where the code empties the holder again and again, if it does.
    ``bytes_per_step`` is tensor bytes per step plus, for autograd graphs, an estimate of the
    nodes kept alive (``estimated`` is then True).
    """

    holder: str
    kind: str
    filename: str
    lineno: int
    bytes_per_step: int
    fix: str
    origin: str = ""
    total_bytes: int = 0
    items_per_step: float = 0.0
    nodes_per_step: float = 0.0
    estimated: bool = False
    series: list[int] = field(default_factory=list)
    detail: str = ""
    severity: str = "leak"
    #: where the code empties the holder (``train.py:57 (on_train_epoch_end)``): a sawtooth,
    #: bounded by that period, so the projection stops there
    cleared_at: str = ""

    @property
    def where(self) -> str:
        return f"{self.filename}:{self.lineno}" if self.lineno else "line unknown"

    @property
    def projection(self) -> str:
        """What the rate means for a run: ``+526 KiB/step = 5 GiB after 10,000 steps``, or, for a
        holder the code empties periodically, ``+256 B/step until emptied at train.py:57 (...)``."""
        if self.cleared_at:
            return f"+{format_size(self.bytes_per_step)}/step until emptied at {self.cleared_at}"
        return (f"+{format_size(self.bytes_per_step)}/step = "
                f"{format_size(self.bytes_per_step * PROJECTION_STEPS)} after {PROJECTION_STEPS:,} steps")

    def __str__(self) -> str:
        name = f"{self.holder} ({self.detail})" if self.detail else self.holder
        if self.severity == "minor":
            rate = format_size(self.bytes_per_step)
            if self.cleared_at:
                grows = f"grows by {rate}/step until emptied at {self.cleared_at}"
            else:
                what = "grows" if self.detail else "a log of scalars that grows"
                grows = (f"{what} by {rate}/step ({format_size(self.bytes_per_step * PROJECTION_STEPS)} "
                         f"after {PROJECTION_STEPS:,} steps)")
            return f"{name}: slow growth, not a leak: {grows}, extended at {self.where}\n    fix: {self.fix}"
        return (f"{name}: {KINDS.get(self.kind, self.kind)}, {self.projection}, "
                f"extended at {self.where}\n    fix: {self.fix}")


@dataclass(frozen=True)
class LeakReport:
    leaks: list[Leak]
    steps: int
    warmup: int
    holders_tracked: int
    lines: bool
    notes: list[str] = field(default_factory=list)
    #: slow growth that is not a leak (detached scalars logged every step), ranked after leaks
    minor: list[Leak] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing leaks."""
        return not self.leaks

    def leak(self, holder: str) -> Leak | None:
        """The leak of ``holder``, if any."""
        return next((leak for leak in self.leaks if leak.holder == holder), None)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("leaks", "minor"):
            for item, leak in zip(data[key], getattr(self, key), strict=True):
                item["projection"] = leak.projection
        return data

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        head = (f"{len(self.leaks)} leak(s) after {self.steps} steps ({self.warmup} warm-up), "
                f"{self.holders_tracked} holders tracked")
        if not self.leaks:
            head = f"no leak: {self.holders_tracked} holders tracked over {self.steps} steps ({self.warmup} warm-up)"
        return "\n".join([head, *(f"  {leak}" for leak in self.leaks), *(f"  {m}" for m in self.minor),
                          *(f"  note: {n}" for n in self.notes)])

    def __rich__(self) -> Any:
        from rich.table import Table

        table = Table(title=str(self).splitlines()[0], title_justify="left")
        for column in ("holder", "kind", "per step", "line", "fix"):
            table.add_column(column, justify="right" if column == "per step" else "left")
        for leak in [*self.leaks, *self.minor]:
            name = f"{leak.holder} ({leak.detail})" if leak.detail else leak.holder
            kind = "slow growth, not a leak" if leak.severity == "minor" else KINDS.get(leak.kind, leak.kind)
            table.add_row(name, kind, format_size(leak.bytes_per_step), leak.where, leak.fix)
        if self.notes:
            table.caption = "\n".join(self.notes)
            table.caption_justify = "left"
        return table


def coverage_notes(leaks: list[Leak], steps: int, warmup: int, *, lines: bool, cycles: bool,
                   allocated_rate: float | None) -> list[str]:
    """What a report could not check or explain: too few steps, unknown lines, checks switched
    off, CUDA growth (``allocated_rate`` bytes/step) the named holders do not explain."""
    notes = []
    if steps - warmup < 2:
        notes.append(f"only {steps} step(s) measured with warmup={warmup}: "
                     f"a leak needs at least 2 steps after warm-up to show")
    if any(leak.lineno == 0 for leak in leaks) and lines:
        notes.append("some lines are unknown: the holder grew inside library code or only once traced")
    if not lines:
        notes.append("line attribution off (lines=False)")
    if not cycles:
        notes.append("cycles=False: reference cycles and memory no name reaches not checked")
    explained = sum(leak.bytes_per_step for leak in leaks)
    if allocated_rate is not None and explained < 0.5 * allocated_rate:
        notes.append(f"CUDA memory allocated grows by {format_size(allocated_rate)}/step but the holders "
                     f"found explain {format_size(explained)}/step: look at dk.memory.census() "
                     f"between steps")
    return notes
