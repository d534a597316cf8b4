"""The plan of a split model: which layers go on which device, and what each part costs.

``dk.split``, ``dk.Pipeline`` and ``dk.plan_devices`` all return or carry a :class:`Plan`. Print
it (``print(plan)``; rich renders it as a table too) to see parts, layers, parameters,
estimated memory and time per device, and the expected balance (largest part over the mean).

Usage::

    import devicekit as dk

    plan = dk.plan_devices(model, {"cuda:1": "20GiB", "cuda:3": "20GiB"}, sample=batch)
    print(plan)            # the table, then one line per reason
    plan.devices           # [device('cuda:1'), device('cuda:3')]
    plan.counts            # [12, 11]: layers per part, usable as split(..., balance=plan.counts)
    model = dk.split(model, plan)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from devicekit.errors import InvalidValueError
from devicekit.modelparallel.balance import max_over_mean
from devicekit.units import format_size

if TYPE_CHECKING:
    from torch import nn

    from devicekit.modelparallel.layer_profile import LayerCost

__all__ = ["Part", "Plan", "check_counts", "plan_from_counts"]


@dataclass(frozen=True)
class Part:
    """One consecutive run of layers on one device."""

    index: int
    device: torch.device
    start: int
    stop: int
    layer_names: tuple[str, ...]
    parameters: int
    #: estimated bytes the part holds on its device (see Plan.basis for what is counted)
    memory: int
    #: measured forward + backward seconds on the sample (None: not measured)
    seconds: float | None = None
    #: the device's usable budget in bytes (plan_devices only)
    budget: int | None = None
    #: modules placed here because they share a parameter or buffer with a module of this part
    tied_names: tuple[str, ...] = ()

    @property
    def layers(self) -> int:
        return self.stop - self.start

    @property
    def layer_range(self) -> str:
        if not self.layer_names:
            text = "-"
        elif len(self.layer_names) == 1:
            text = self.layer_names[0]
        else:
            text = f"{self.layer_names[0]} .. {self.layer_names[-1]}"
        if self.tied_names:
            text += " + " + ", ".join(self.tied_names) + " (tied)"
        return text


@dataclass
class Plan:
    """Parts in pipeline order, what balanced them, and why."""

    parts: list[Part]
    #: what the balance was computed on: "size", "time" or "given" (explicit layer counts)
    basis: str
    #: what the memory column counts, e.g. "training with adam: weights + grads + 2x state + activations"
    memory_basis: str = ""
    reasons: list[str] = field(default_factory=list)
    #: shared parameters/buffers and where they live, e.g. "lm_head.weight = wte.weight: on cpu (part 0)"
    tied: list[str] = field(default_factory=list)

    @property
    def devices(self) -> list[torch.device]:
        return [p.device for p in self.parts]

    @property
    def counts(self) -> list[int]:
        return [p.layers for p in self.parts]

    @property
    def max_over_mean(self) -> float:
        """Largest part over the mean part of the balanced cost (time if measured, else memory)."""
        if self.basis == "time" and all(p.seconds is not None for p in self.parts):
            return max_over_mean([p.seconds or 0.0 for p in self.parts])
        return max_over_mean([p.memory for p in self.parts])

    @property
    def device_map(self) -> dict[str, str]:
        """Layer name -> device, as accelerate's ``device_map``."""
        return {name: str(p.device) for p in self.parts for name in (*p.layer_names, *p.tied_names)}

    @property
    def total_memory(self) -> int:
        return sum(p.memory for p in self.parts)

    def rows(self) -> list[list[str]]:
        """The table as strings: one row per part."""
        rows = []
        for p in self.parts:
            share = f"{100 * p.memory / p.budget:.0f}% of {format_size(p.budget)}" if p.budget else "-"
            rows.append([
                str(p.index), str(p.device), p.layer_range, str(p.layers), f"{p.parameters:,}",
                format_size(p.memory), share,
                "-" if p.seconds is None else f"{p.seconds * 1e3:.2f} ms",
            ])
        return rows

    _HEADER = ("part", "device", "layers", "count", "parameters", "memory", "budget", "time")

    def title(self) -> str:
        return (f"{len(self.parts)} part(s), balanced by {self.basis}: "
                f"largest/mean part = {self.max_over_mean:.2f}")

    def __str__(self) -> str:
        rows = [list(self._HEADER), *self.rows()]
        widths = [max(len(r[c]) for r in rows) for c in range(len(self._HEADER))]
        lines = [self.title()]
        for r in rows:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
        if self.memory_basis:
            lines.append(f"memory: {self.memory_basis}")
        lines.extend(f"tied: {tie}" for tie in self.tied)
        lines.extend(f"- {reason}" for reason in self.reasons)
        return "\n".join(lines)

    def __rich__(self) -> object:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(title=self.title())
        for name in self._HEADER:
            table.add_column(name, justify="right" if name in ("count", "parameters", "memory", "time") else "left")
        for row in self.rows():
            table.add_row(*row)
        notes = [f"memory: {self.memory_basis}"] if self.memory_basis else []
        notes += [f"tied: {t}" for t in self.tied]
        notes += [f"- {r}" for r in self.reasons]
        return Group(table, *(Text(n) for n in notes))


def check_counts(counts: Any, layers: int, parts: int, *, what: str = "layer") -> list[int]:
    """Validate explicit counts: ``parts`` positive ints summing to ``layers``."""
    try:
        values = [int(c) for c in counts]
    except (TypeError, ValueError):
        raise InvalidValueError(f"balance {counts!r} is not a list of {what} counts; e.g. [3, 2]") from None
    if any(isinstance(c, bool) for c in counts) or any(v < 1 for v in values):
        raise InvalidValueError(f"balance {counts!r} must hold positive {what} counts, one per device")
    if len(values) != parts:
        raise InvalidValueError(f"balance {counts!r} has {len(values)} entries for {parts} device(s); give one per device")
    if sum(values) != layers:
        raise InvalidValueError(f"balance {counts!r} sums to {sum(values)} but the model has {layers} {what}s")
    return values


def plan_from_counts(
    layers: Sequence[tuple[str, nn.Module]],
    costs: Sequence[LayerCost],
    devices: Sequence[torch.device],
    counts: Sequence[int],
    *,
    basis: str,
    optimizer: float,
    training: bool = True,
    reasons: list[str] | None = None,
    budgets: Sequence[int | None] | None = None,
) -> Plan:
    """A :class:`Plan` from layer (or unit) counts per device; zero-count devices are left out."""
    parts: list[Part] = []
    start = 0
    for i, (device, count) in enumerate(zip(devices, counts, strict=True)):
        if count == 0:
            continue
        chunk = costs[start:start + count]
        seconds = [c.seconds for c in chunk]
        memory = sum(c.memory(training=training, optimizer=optimizer) for c in chunk)
        memory += max((c.transient_bytes for c in chunk), default=0)  # peak working set
        parts.append(Part(
            index=len(parts), device=device, start=start, stop=start + count,
            layer_names=tuple(name for name, _ in layers[start:start + count]),
            parameters=sum(c.parameters for c in chunk), memory=int(memory),
            seconds=None if any(s is None for s in seconds) else float(sum(s or 0.0 for s in seconds)),
            budget=None if budgets is None else budgets[i],
        ))
        start += count
    if training:
        what = (f"training, optimizer state = {optimizer:g}x weights: weights + grads + state + saved "
                "activations + the largest layer's input and output")
    else:
        what = "inference: weights + buffers + the largest layer's input and output"
    return Plan(parts=parts, basis=basis, memory_basis=what, reasons=list(reasons or []))
