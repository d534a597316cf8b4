"""Consecutive parts of a chain of layers: the plan a pipeline runs, one part after another.

A :class:`~devicekit.modelparallel.pipeline.Pipeline` (and a pipeline stage per process) runs
its parts in order, each on its device, handing the activation on; so each part must be a run
of *consecutive* layers of the chain (``sequential_layers``: a plain ``nn.Sequential``, nested
ones flattened, or the traced chain of any module). Layers that share a parameter or a layer
object (:mod:`~devicekit.modelparallel.sharing`) are kept in one part when the parts sit on
different devices or processes; a tie that cannot be kept in one part is refused, naming the
tied parameter and the layers it ties.

``dk.split`` does not need this: it places units anywhere (a device map need not be
consecutive) and hooks move the activations, see :mod:`~devicekit.modelparallel.module_split`.
A :class:`~devicekit.modelparallel.partition.Plan` from ``dk.plan_devices`` or ``dk.split`` is
accepted here when its parts are consecutive runs of the chain's layers.

Usage::

    import torch
    from torch import nn
    from devicekit.modelparallel.layer_plan import resolve, make_parts

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    layers, plan = resolve(model, ["cpu", "cpu"], "size", None, "adam")
    parts = make_parts(layers, plan)           # two nn.Sequential slices, on their devices
    print(plan.counts)                         # [2, 1] (or [1, 2]): layers per part
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from devicekit.errors import InvalidValueError, SplitError
from devicekit.modelparallel.balance import balance_cost
from devicekit.modelparallel.device_list import parse_devices
from devicekit.modelparallel.layer_profile import (
    optimizer_factor,
    profile_layers,
    sequential_layers,
)
from devicekit.modelparallel.partition import Plan, check_counts, plan_from_counts
from devicekit.modelparallel.sharing import (
    Span,
    block_costs,
    blocks,
    check_cuts,
    expand_counts,
    find_spans,
    must_keep_together,
)
from devicekit.modelparallel.stays import refuse_if_split

__all__ = ["Balance", "build_plan", "sharing_reasons", "make_parts", "resolve", "consecutive_plan"]

Balance = str | Sequence[int]


def build_plan(
    layers: list[tuple[str, nn.Module]],
    devices: list[torch.device],
    *,
    balance: Balance = "size",
    sample: Any = None,
    optimizer: str | float | None = "adam",
    separate: bool = False,
) -> Plan:
    """Measure the layers and cut them into ``len(devices)`` balanced consecutive parts.

    Layers that share an object stay on one device when the devices differ (or, with
    ``separate``, always: each part is its own process's copy)."""
    factor = optimizer_factor(optimizer)
    reasons: list[str] = []
    spans = find_spans(layers)
    together = bool(spans) and must_keep_together(devices, separate=separate)
    if isinstance(balance, str):
        if balance not in ("size", "time"):
            raise InvalidValueError(f"balance {balance!r} is unknown; use 'size', 'time' or a list of layer counts")
        if len(devices) > len(layers):
            raise SplitError(
                f"cannot cut {len(layers)} layer(s) into {len(devices)} parts; pass at most {len(layers)} devices"
            )
        runs = blocks(len(layers), spans) if together else [(i, i + 1) for i in range(len(layers))]
        if len(devices) > len(runs):
            widest = max(spans, key=lambda s: s.last - s.first)
            raise SplitError(
                f"{widest.what}, so layers {widest.first}..{widest.last} must stay in one part of the "
                f"pipeline (its parts run one after another); the rest cannot fill {len(devices)} parts: "
                f"pass at most {len(runs)} devices, untie it, or use dk.split, which places tied layers "
                "together wherever they are"
            )
        costs = profile_layers(layers, sample, measure_time=balance == "time")
        weights = ([c.seconds or 0.0 for c in costs] if balance == "time"
                   else [c.memory(training=True, optimizer=factor) for c in costs])
        counts = expand_counts(balance_cost(block_costs(weights, runs), len(devices)), runs)
        basis = balance
        if sample is None:
            reasons.append("no sample given: activations are not counted; pass sample=<a batch> to count them")
    else:
        counts = check_counts(balance, len(layers), len(devices))
        if together:
            check_cuts(spans, counts, devices, separate=separate)
        costs = profile_layers(layers, sample)
        basis = "given"
    reasons.append(f"{len(layers)} layers cut into {len(devices)} consecutive parts: {counts}")
    reasons.extend(sharing_reasons(spans, together, devices))
    return plan_from_counts(layers, costs, devices, counts, basis=basis, optimizer=factor, reasons=reasons)


def sharing_reasons(spans: Sequence[Span], together: bool, devices: Sequence[torch.device]) -> list[str]:
    """One plan line per shared object: kept on one device, or harmless on one device."""
    if together:
        return [f"{s.what}: layers {s.first}..{s.last} kept on one device" for s in spans]
    return [f"{s.what}: every part is on {devices[0]}, so they share one copy" for s in spans]


def make_parts(layers: list[tuple[str, nn.Module]], plan: Plan) -> list[nn.Sequential]:
    """Move each part's layers to its device and wrap them in an ``nn.Sequential``."""
    parts = []
    for part in plan.parts:
        chunk = layers[part.start:part.stop]
        seq = nn.Sequential(OrderedDict((name.replace(".", "_"), layer) for name, layer in chunk))
        if part.device.type != "meta" and any(
            t.device.type == "meta" for t in (*seq.parameters(), *seq.buffers())
        ):
            raise SplitError(
                f"layers {part.layer_range} have parameters on the meta device and cannot move to "
                f"{part.device}; use dk.plan_devices on the meta model, then build the real model and split it"
            )
        parts.append(seq.to(part.device))
    return parts


def consecutive_plan(layers: Sequence[tuple[str, nn.Module]], plan: Plan) -> Plan:
    """``plan`` as consecutive runs of ``layers``, or a refusal naming what breaks the order.

    A plan whose parts name the chain's layers (``dk.plan_devices`` of a Sequential, where tied
    layers join the part of the first one) is re-read in layer order: each part must be one run
    of consecutive layers, since a pipeline runs its parts one after another. A plan made on
    other names (a traced chain's stages) is taken by its counts."""
    names = [name for name, _ in layers]
    owner = {name: p.index for p in plan.parts for name in (*p.layer_names, *p.tied_names)}
    placed = {id(module): name for name, module in layers if name in owner}
    same: dict[str, str] = {}  # a layer object listed again runs where it was placed
    for name, module in layers:
        if name not in owner and id(module) in placed:
            same[name] = placed[id(module)]
            owner[name] = owner[placed[id(module)]]
    missing = [name for name in names if name not in owner]
    if missing:
        inside = [n for n in owner if n.startswith(f"{missing[0]}.")]
        if inside:
            where = ", ".join(f"{n} on {plan.parts[owner[n]].device}" for n in inside)
            raise SplitError(
                f"the plan places layer {missing[0]!r} in pieces ({where}); a pipeline part holds whole layers: "
                "use dk.split(model, plan), which runs any device map, or budgets in which each layer fits whole"
            )
        if sum(plan.counts) != len(layers) or any(p.tied_names for p in plan.parts):
            raise SplitError(f"plan covers {sum(plan.counts)} layers but the model has {len(layers)}; plan this model")
        return plan
    order = [owner[name] for name in names]
    for i in range(1, len(order)):
        if order[i] < order[i - 1]:
            later, earlier = plan.parts[order[i - 1]], plan.parts[order[i]]
            held = next((n for n in names[:i] if owner[n] == order[i]), names[i])
            raise SplitError(
                f"the plan puts layer {names[i]!r} on {earlier.device} with {held!r} "
                f"({'the same module' if names[i] in same else _tie_of(plan, names[i])}), "
                f"after layer {names[i - 1]!r} on {later.device}; a pipeline runs its parts one after another, "
                "so each part must be consecutive layers: use dk.split(model, plan), which runs any device "
                "map, or untie the layers"
            )
    parts, start = [], 0
    for part in plan.parts:
        count = order.count(part.index)
        parts.append(replace(part, start=start, stop=start + count, tied_names=(),
                             layer_names=tuple(names[start:start + count])))
        start += count
    return replace(plan, parts=[p for p in parts if p.layers])


def _tie_of(plan: Plan, name: str) -> str:
    """The plan's tie line that names ``name``, e.g. "tied: 2.weight = 0.weight"."""
    found = [t.split(":")[0] for t in plan.tied if any(side.strip().startswith(f"{name}.")
                                                      for side in t.split(":")[0].split(" = "))]
    return "tied: " + "; ".join(found) if found else "placed together"


def resolve(
    model: nn.Module, devices: Any, balance: Balance, sample: Any, optimizer: str | float | None,
    *, separate: bool = False,
) -> tuple[list[tuple[str, nn.Module]], Plan]:
    """The layers of ``model`` and the plan for ``devices`` (a device list or a ready Plan).

    ``separate``: each part runs in its own process, so shared objects must stay in one part."""
    refuse_if_split(model)
    layers = sequential_layers(model)
    if isinstance(devices, Plan):
        plan = consecutive_plan(layers, devices)
        parse_devices(plan.devices)  # a plan made for GPUs this process cannot see is refused here
        spans = find_spans(layers)
        if spans and must_keep_together(plan.devices, separate=separate):
            check_cuts(spans, plan.counts, plan.devices, separate=separate)
        return layers, plan
    return layers, build_plan(layers, parse_devices(devices), balance=balance, sample=sample,
                              optimizer=optimizer, separate=separate)
