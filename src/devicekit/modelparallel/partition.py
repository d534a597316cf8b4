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

from dataclasses import dataclass, field

import torch

from devicekit.modelparallel.balance import max_over_mean
from devicekit.units import format_size

__all__ = ["Part", "Plan"]


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
