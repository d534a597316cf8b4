"""Plan where a model goes: how many devices, which layers on which, within memory budgets.

Given budgets per device (or, by default, the free memory the inventory reports minus a
headroom, plus the host's available RAM), :func:`plan_devices` picks the fewest GPUs whose
budgets hold the model, balances the layers over them, and offloads the tail to the CPU only
when the GPUs cannot hold it all. Unlike accelerate's ``infer_auto_device_map`` it:

* leaves ``headroom`` (10 % of each GPU by default) instead of filling GPUs to the brim;
* works with any device ids (GPUs 1 and 3), never assuming the first GPU is ``cuda:0``;
* counts what training needs: weights, gradients, optimizer state and the activations autograd
  saves (measured with a ``sample``, on the meta device if the model lives there), plus the
  largest layer's input and output as working space; ``training=False`` counts inference.

``spread=True`` uses every GPU instead (for a pipeline, where more stages work at once).
The result is a :class:`~devicekit.modelparallel.partition.Plan`: print it for the table and the
reasons; hand it to ``dk.split`` or ``dk.Pipeline``.

Usage::

    import torch
    import devicekit as dk

    with torch.device("meta"):
        model = build_model()                         # 1B parameters, no memory allocated
    plan = dk.plan_devices(model, {1: "40GiB", 3: "40GiB", "cpu": "64GiB"},
                           sample=torch.empty(8, 512, dtype=torch.long, device="meta"))
    print(plan)
    model = dk.split(build_model(), plan)             # the real model, placed as planned
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from devicekit.errors import InvalidValueError, SplitError
from devicekit.modelparallel.balance import fit_capacities
from devicekit.modelparallel.device_list import parse_device
from devicekit.modelparallel.layer_profile import (
    optimizer_factor,
    profile_layers,
    sequential_layers,
)
from devicekit.modelparallel.partition import Plan
from devicekit.modelparallel.sharing import block_costs, blocks, expand_counts, find_spans
from devicekit.modelparallel.split import plan_from_counts, sharing_reasons
from devicekit.units import format_size, parse_size

__all__ = ["plan_devices", "Budget", "default_budgets"]


@dataclass(frozen=True)
class Budget:
    """Bytes a device may hold for this model, and where the number came from."""

    device: torch.device
    usable: int
    note: str


def _visible_ordinals(gpus: Sequence[Any]) -> list[tuple[Any, int]]:
    """Pair each GPU this process may use with the ordinal torch gives it (hardware.visible)."""
    from devicekit.hardware.visible import visible_devices

    return [(device.gpu, device.ordinal) for device in visible_devices(gpus)]


def default_budgets(headroom: float) -> list[Budget]:
    """Free GPU memory from the inventory minus ``headroom`` x total, and available host RAM."""
    import psutil

    from devicekit.hardware.inventory import gpus

    budgets = []
    for gpu, ordinal in _visible_ordinals(gpus()):
        keep = int(headroom * gpu.memory_total)
        usable = max(gpu.memory_free - keep, 0)
        budgets.append(Budget(torch.device("cuda", ordinal), usable,
                              f"{format_size(gpu.memory_free)} free of {format_size(gpu.memory_total)}, "
                              f"{format_size(keep)} kept as headroom"))
    available = psutil.virtual_memory().available
    keep = int(headroom * available)
    budgets.append(Budget(torch.device("cpu"), available - keep,
                          f"{format_size(available)} RAM available, {format_size(keep)} kept as headroom"))
    return budgets


def _given_budgets(max_memory: Mapping[Any, Any]) -> list[Budget]:
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise InvalidValueError(
            f"max_memory {max_memory!r} must be a non-empty dict such as {{'cuda:0': '20GiB', 'cpu': '64GiB'}}"
        )
    budgets: dict[torch.device, Budget] = {}
    for key, value in max_memory.items():
        device = parse_device(key, check=False, name="max_memory key")
        if device in budgets:
            raise InvalidValueError(f"max_memory names {device} twice ({key!r}); give each device once")
        size = parse_size(value, name=f"max_memory[{key!r}]")
        budgets[device] = Budget(device, size, f"{format_size(size)} as given")
    return list(budgets.values())


def _order(budgets: list[Budget]) -> tuple[list[Budget], list[Budget]]:
    gpus = sorted((b for b in budgets if b.device.type == "cuda"), key=lambda b: b.device.index or 0)
    others = [b for b in budgets if b.device.type != "cuda"]
    return gpus, others


def plan_devices(
    model: nn.Module,
    max_memory: Mapping[Any, Any] | None = None,
    sample: Any = None,
    *,
    headroom: float = 0.1,
    training: bool = True,
    optimizer: str | float | None = "adam",
    devices: Sequence[Any] | None = None,
    spread: bool = False,
) -> Plan:
    """Choose devices and layers per device within budgets; see the module doc.

    ``spread=True`` uses every GPU with a budget (balanced) instead of the fewest that fit:
    what a :class:`~devicekit.modelparallel.pipeline.Pipeline` wants, since more stages work at once.
    """
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
        raise InvalidValueError(f"headroom {headroom!r} must be a fraction in [0, 1), e.g. 0.1")
    factor = optimizer_factor(optimizer) if training else 0.0
    plain = isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward
    if plain:
        layers = sequential_layers(model)
        costs = profile_layers(layers, sample)
    budgets = _given_budgets(max_memory) if max_memory is not None else default_budgets(headroom)
    if devices is not None:
        wanted = [parse_device(d, check=False, name="devices entry") for d in devices]
        known = {b.device: b for b in budgets}
        missing = [str(d) for d in wanted if d not in known]
        if missing:
            raise InvalidValueError(
                f"devices {missing} have no budget; available: {[str(d) for d in known]}"
            )
        budgets = [known[d] for d in dict.fromkeys(wanted)]
    if not plain:  # any other module: its submodules, in the order they run
        from devicekit.modelparallel.module_plan import plan_module_budgets

        return plan_module_budgets(model, budgets, sample, factor=factor, training=training, spread=spread)
    return plan_costs(layers, costs, budgets, sample_given=sample is not None, factor=factor,
                      training=training, spread=spread)


def plan_costs(layers: list[tuple[str, nn.Module]], costs: list[Any], budgets: list[Budget], *,
               sample_given: bool, factor: float, training: bool, spread: bool) -> Plan:
    """The plan for measured layers (or units) within ``budgets``; see :func:`plan_devices`."""
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

    spans = find_spans(layers)  # repeated layers and tied parameters stay on one device
    runs = blocks(len(layers), spans)
    units = block_costs(sizes, runs)
    reasons.extend(sharing_reasons(spans, True, []))

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
            reasons.append(f"spread over {len(used)} GPU(s) ({names}), layers balanced among them" if spread
                           else f"{len(used)} of {len(gpus)} GPU(s) suffice ({names}): fewest devices, "
                           "most free memory first; layers balanced among them")
            return _finish(layers, costs, chosen, expand_counts(counts, runs), factor, training, reasons)
    # 2. GPUs take the longest prefix they can hold (balanced); the rest runs on the CPU
    cpu = next((b for b in others if b.device.type == "cpu"), None)
    prefix_counts = _longest_prefix(units, [capacity(b) for b in gpus])
    on_gpus = sum(prefix_counts)
    if cpu is not None and sum(units[on_gpus:]) + working <= cpu.usable:
        if on_gpus:
            prefix_counts = fit_capacities(units[:on_gpus], [capacity(b) for b in gpus]) or prefix_counts
        counts = expand_counts([*prefix_counts, len(runs) - on_gpus], runs)
        if gpus:
            held = sum(counts[:-1])
            reasons.append(f"the GPUs hold {held} of {len(layers)} layers; the last {counts[-1]} run on cpu "
                           "(offloaded: slower, but it fits)")
        return _finish(layers, costs, gpus + [cpu], counts, factor, training, reasons)
    biggest = max(range(len(sizes)), key=lambda i: sizes[i])
    room = ", ".join(f"{b.device} {format_size(b.usable)}" for b in gpus + others)
    raise SplitError(
        f"model needs {format_size(need)} for {mode} (largest layer {layers[biggest][0]!r}: "
        f"{format_size(sizes[biggest])}) but the budgets ({room}) cannot hold it; add devices, "
        "raise max_memory, use a smaller batch or training=False"
    )


def _longest_prefix(sizes: list[float], capacities: list[float]) -> list[int]:
    """Greedy fill: how many leading layers each device takes, in order, within its capacity."""
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

