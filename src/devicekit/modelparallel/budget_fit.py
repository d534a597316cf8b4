"""Fit measured units into memory budgets: the fewest GPUs, balanced, the tail offloaded to the CPU.

The fitting half of ``dk.plan_devices`` (:mod:`~devicekit.modelparallel.plan` gathers the
budgets, :mod:`~devicekit.modelparallel.module_plan` measures the units): given the units of a
model in the order they run (tied units already merged into one group each) and their costs,
:func:`plan_costs` picks the fewest GPUs whose budgets hold them, balances the units among those
(largest part as small as possible), and only when the GPUs cannot hold everything puts the
longest prefix they can hold on them and the rest on the CPU. A model that fits nowhere is
refused with one line naming the need, the largest unit and the budgets.

Usage::

    import torch
    from devicekit.modelparallel.budget_fit import Budget, plan_costs

    budgets = [Budget(torch.device("cuda", 0), 400, "as given"),
               Budget(torch.device("cuda", 1), 500, "as given")]
    plan = plan_costs(units, costs, budgets, sample_given=False, factor=0.0,
                      training=False, spread=False)      # units, costs: from module_plan
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from devicekit.errors import SplitError
from devicekit.modelparallel.balance import fit_capacities
from devicekit.modelparallel.partition import Plan, plan_from_counts
from devicekit.units import format_size

__all__ = ["Budget", "plan_costs"]


@dataclass(frozen=True)
class Budget:
    """Bytes a device may hold for this model, and where the number came from."""

    device: torch.device
    usable: int
    note: str


def _order(budgets: list[Budget]) -> tuple[list[Budget], list[Budget]]:
    gpus = sorted((b for b in budgets if b.device.type == "cuda"), key=lambda b: b.device.index or 0)
    others = [b for b in budgets if b.device.type != "cuda"]
    return gpus, others


def plan_costs(layers: list[tuple[str, nn.Module]], costs: list[Any], budgets: list[Budget], *,
               sample_given: bool, factor: float, training: bool, spread: bool,
               tied: Mapping[str, str] | None = None) -> Plan:
    """The plan for measured units within ``budgets`` (see the module doc).

    ``layers`` are the units in run order, one per tie group (its cost counts every member);
    ``tied`` names, per group anchor, the tie that holds its members together (for refusals)."""
    gpus, others = _order(budgets)

    sizes = [c.memory(training=training, optimizer=factor) for c in costs]
    working = max((c.transient_bytes for c in costs), default=0)
    need = sum(sizes) + working
    mode = f"training with optimizer state {factor:g}x weights" if training else "inference"
    reasons = [f"{b.device}: {format_size(b.usable)} usable ({b.note})" for b in gpus + others]
    reasons.append(f"model needs {format_size(need)} for {mode}: weights "
                   f"{format_size(sum(c.param_bytes + c.buffer_bytes for c in costs))}, saved activations "
                   f"{format_size(sum(c.activation_bytes for c in costs)) if training else '0 B'}, "
                   f"working space {format_size(working)}")
    if not sample_given:
        reasons.append("no sample given: activations are not counted; pass sample=<one batch> (meta is fine)")

    units = sizes

    def capacity(b: Budget) -> float:
        return float(b.usable - working)

    # 1. the fewest GPUs (largest budgets first) that hold every layer, balanced among them
    by_room = sorted(gpus, key=lambda b: -b.usable)
    for k in range(len(by_room) if spread else 1, len(by_room) + 1):
        chosen = sorted(by_room[:k], key=lambda b: b.device.index or 0)
        counts = fit_capacities(units, [capacity(b) for b in chosen])
        if counts is not None:
            used = [b for b, n in zip(chosen, counts, strict=True) if n]
            names = ", ".join(str(b.device) for b in used)
            reasons.append(f"spread over {len(used)} GPU(s) ({names}), units balanced among them" if spread
                           else f"{len(used)} of {len(gpus)} GPU(s) suffice ({names}): fewest devices, "
                           "most free memory first; units balanced among them")
            return _finish(layers, costs, chosen, counts, factor, training, reasons)
    # 2. GPUs take the longest prefix they can hold (balanced); the rest runs on the CPU
    cpu = next((b for b in others if b.device.type == "cpu"), None)
    prefix_counts = _longest_prefix(units, [capacity(b) for b in gpus])
    on_gpus = sum(prefix_counts)
    if cpu is not None and sum(units[on_gpus:]) + working <= cpu.usable:
        if on_gpus:
            prefix_counts = fit_capacities(units[:on_gpus], [capacity(b) for b in gpus]) or prefix_counts
        counts = [*prefix_counts, len(units) - on_gpus]
        if gpus:
            held = sum(counts[:-1])
            reasons.append(f"the GPUs hold {held} of {len(layers)} units; the last {counts[-1]} run on cpu "
                           "(offloaded: slower, but it fits)")
        return _finish(layers, costs, gpus + [cpu], counts, factor, training, reasons)
    biggest = max(range(len(sizes)), key=lambda i: sizes[i])
    room = ", ".join(f"{b.device} {format_size(b.usable)}" for b in gpus + others)
    name = layers[biggest][0]
    why = f", held together by the tie {tied[name]}" if tied and name in tied else ""
    raise SplitError(
        f"model needs {format_size(need)} for {mode} (largest unit {name!r}{why}: "
        f"{format_size(sizes[biggest])}) but the budgets ({room}) cannot hold it; add devices, "
        "raise max_memory, use a smaller batch or training=False"
    )


def _longest_prefix(sizes: list[float], capacities: list[float]) -> list[int]:
    """Greedy fill: how many leading units each device takes, in order, within its capacity."""
    counts, i = [], 0
    for cap in capacities:
        total, n = 0.0, 0
        while i < len(sizes) and total + sizes[i] <= cap:
            total += sizes[i]
            i += 1
            n += 1
        counts.append(n)
    return counts


def _finish(layers: list[tuple[str, nn.Module]], costs: list[Any], budgets: list[Budget],
            counts: list[int], factor: float, training: bool, reasons: list[str]) -> Plan:
    plan = plan_from_counts(layers, costs, [b.device for b in budgets], counts, basis="size",
                            optimizer=factor, training=training, reasons=reasons,
                            budgets=[b.usable for b in budgets])
    for part in plan.parts:  # the invariant the caller relies on
        if part.budget is not None and part.memory > part.budget:
            raise SplitError(f"internal planning error: part on {part.device} needs "
                             f"{format_size(part.memory)} > budget {format_size(part.budget)}")
    return plan

