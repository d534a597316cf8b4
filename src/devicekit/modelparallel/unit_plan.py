"""Plan the units of any ``nn.Module`` over devices: measured, tied units grouped, balanced.

The planning half of ``dk.split`` (:mod:`~devicekit.modelparallel.module_split` places what
this plans) and the measuring half of ``dk.plan_devices``
(:mod:`~devicekit.modelparallel.module_plan`). An ``nn.Sequential`` is a module like any other:
its layers are its units (nested plain Sequentials opened), so both spellings of one network
plan the same way. :func:`unit_costs` finds the units (:mod:`~devicekit.modelparallel.module_units`),
runs the sample once to order and size them, and merges units that share a parameter or buffer
into one group anchored at the member that runs first (each shared tensor counted once): tied
units need not be neighbours, and their group goes wherever its anchor goes. :func:`plan_module`
balances the groups over a device list; :func:`finish_plan` writes the followers and the ties
into the :class:`~devicekit.modelparallel.partition.Plan`.

Usage::

    import torch
    from torch import nn
    from devicekit.modelparallel.unit_plan import plan_module, unit_costs

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model[2].weight = model[0].weight                  # tied across a layer
    measured = unit_costs(model, torch.randn(4, 8))
    measured.followers                                 # {'0': ['2'], '1': []}
    plan = plan_module(model, [torch.device("cpu")] * 2, sample=torch.randn(4, 8))
    print(plan)                                        # '2' placed with '0' (tied)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from devicekit.errors import InvalidValueError, SplitError
from devicekit.modelparallel.balance import balance_cost
from devicekit.modelparallel.layer_profile import LayerCost, optimizer_factor
from devicekit.modelparallel.module_units import Unit, find_units, tie_groups, trace_units
from devicekit.modelparallel.partition import Plan, check_counts, plan_from_counts
from devicekit.modelparallel.stays import refuse_if_split

__all__ = ["Measured", "unit_costs", "plan_module", "finish_plan"]


def _merge(costs: list[LayerCost], name: str) -> LayerCost:
    return LayerCost(
        name=name, parameters=sum(c.parameters for c in costs), param_bytes=sum(c.param_bytes for c in costs),
        buffer_bytes=sum(c.buffer_bytes for c in costs), activation_bytes=sum(c.activation_bytes for c in costs),
        transient_bytes=max(c.transient_bytes for c in costs),
        seconds=None if any(c.seconds is None for c in costs) else sum(c.seconds or 0.0 for c in costs))


@dataclass
class Measured:
    """A model's units and what planning needs of them."""

    units: list[Unit]
    #: group anchors (the first unit of each tie group to run) in run order, with merged costs
    sequence: list[tuple[str, nn.Module]]
    costs: list[LayerCost]
    #: anchor name -> the units tied to it (placed with it)
    followers: dict[str, list[str]]
    #: "name = other name" per shared tensor
    ties: list[str]
    opened: frozenset[str]
    #: modules that must stay whole (their children never run on their own)
    sealed: frozenset[str] = frozenset()
    #: anchor name -> "name = other name" of the ties that hold its group together
    group_ties: dict[str, list[str]] = field(default_factory=dict)
    #: unit name -> the other names the same module object is registered under (it runs at each)
    repeats: dict[str, list[str]] = field(default_factory=dict)
    #: unit name -> how often it ran in one forward on the sample (every unit once without a sample)
    calls: dict[str, int] = field(default_factory=dict)

    def tie_of(self, anchor: str) -> str:
        """The ties holding ``anchor``'s group together, for messages ("" when untied)."""
        ties = self.group_ties.get(anchor, [])
        if not ties:
            return ""
        shown = "; ".join(ties[:3]) + (f"; and {len(ties) - 3} more" if len(ties) > 3 else "")
        return f"{shown} (tied units {', '.join([anchor, *self.followers.get(anchor, [])])})"


def unit_costs(
    model: nn.Module, sample: Any, *, measure_time: bool = False, opened: frozenset[str] = frozenset(),
    at_least: int = 1,
) -> Measured:
    """Find, trace and group the units of ``model``; a module opened into children that never
    run (its forward uses their weights directly, as ``nn.MultiheadAttention`` does) is closed."""
    refuse_if_split(model)
    if isinstance(model, (nn.ModuleList, nn.ModuleDict)):
        raise SplitError(f"model is an nn.{type(model).__name__}, which has no forward and no order of "
                         "execution; if its children run one after another, pass nn.Sequential(*model_list)")
    sealed: frozenset[str] = frozenset()
    while True:
        units, now = find_units(model, opened=opened, at_least=at_least, sealed=sealed)
        costs, order, called = trace_units(model, units, sample, measure_time=measure_time)
        idle = set()
        used = {id(t) for i in called for _, t in units[i].tensors()}
        for i, unit in enumerate(units):  # close the innermost opened module of a unit that never ran
            own = list(unit.module.parameters())
            if all(id(t) in used for t in own):
                continue  # no weights of its own (a spare rotary embedding), or only tensors that run elsewhere
                # (Bart's `shared`, tied to both embeddings): its parent's forward does not use its weights
            holders = [name for name in now if i not in called and unit.name.startswith(f"{name}.")]
            if holders:
                idle.add(max(holders, key=len))
        if not idle:
            break
        sealed = sealed | idle
    roots, ties = tie_groups(units)
    groups: dict[int, list[int]] = {}
    for i in order:  # members in run order; the first one run anchors the group
        groups.setdefault(roots[i], []).append(i)
    sequence, merged, followers = [], [], {}
    for i in order:
        members = groups[roots[i]]
        if members[0] != i:
            continue
        merged.append(_group_cost([units[m] for m in members], [costs[m] for m in members]))
        sequence.append((units[i].name, units[i].module))
        followers[units[i].name] = [units[m].name for m in members[1:]]
    group_ties: dict[str, list[str]] = {}
    for a, b, i in ties:
        group_ties.setdefault(units[groups[roots[i]][0]].name, []).append(f"{a} = {b}")
    names_of: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names_of.setdefault(id(module), []).append(name)
    repeats = {u.name: others for u in units
               if (others := [n for n in dict.fromkeys(names_of.get(id(u.module), [])) if n != u.name])}
    return Measured(units, sequence, merged, followers, [f"{a} = {b}" for a, b, _ in ties], now, sealed,
                    group_ties, repeats, {u.name: called[i] for i, u in enumerate(units)})


def _group_cost(members: list[Unit], costs: list[LayerCost]) -> LayerCost:
    """Merged cost of a tie group, each shared tensor counted once."""
    merged = _merge(costs, members[0].name)
    if len(members) == 1:
        return merged
    tensors: dict[int, torch.Tensor] = {}
    for unit in members:
        for _, t in unit.tensors():
            tensors[id(t)] = t
    params = [t for t in tensors.values() if isinstance(t, nn.Parameter)]
    buffers = [t for t in tensors.values() if not isinstance(t, nn.Parameter)]
    return replace(merged, parameters=sum(p.numel() for p in params),
                   param_bytes=sum(p.numel() * p.element_size() for p in params),
                   buffer_bytes=sum(b.numel() * b.element_size() for b in buffers))


def finish_plan(plan: Plan, followers: dict[str, list[str]], ties: list[str], units: Sequence[Unit] = (),
                repeats: dict[str, list[str]] | None = None) -> Plan:
    """Add tied followers to their anchors' parts; name where tied tensors, repeated modules and
    the tensors of opened parents (a model's own positional embedding) live."""
    parts = [replace(p, tied_names=tuple(f for n in p.layer_names for f in followers.get(n, ())))
             for p in plan.parts]
    where = {n: p for p in parts for n in (*p.layer_names, *p.tied_names)}
    lines = []
    for tie in ties:
        owner = tie.split(" = ")[1].split(".")
        part = next((where[".".join(owner[:k])] for k in range(len(owner), -1, -1)
                     if ".".join(owner[:k]) in where), parts[0])
        lines.append(f"{tie}: one tensor, on {part.device} (part {part.index}); its modules run there")
    owned: dict[str, list[str]] = {}
    for unit in units:
        for name, _ in unit.extras:
            owned.setdefault(name.rpartition(".")[0], []).append(name)
    reasons = list(plan.reasons)
    for parent, names in owned.items():  # placed as ModuleSplit places them: with the parent's first unit
        part = next((p for p in parts for n in (*p.layer_names, *p.tied_names)
                     if not parent or n.startswith(f"{parent}.")), parts[0])
        reasons.append(f"{', '.join(names)}: held by {parent or 'the model'} itself, placed on {part.device} "
                       f"(part {part.index}) with its first unit")
    for name, others in (repeats or {}).items():
        part = where.get(name, parts[0])
        reasons.append(f"layer '{name}' repeats as {', '.join(repr(o) for o in others)}: one module, run at "
                       f"each place, kept on one device ({part.device}, part {part.index})")
    return replace(plan, parts=parts, tied=lines, reasons=reasons)


def plan_module(
    model: nn.Module, devices: list[torch.device], *, balance: str | Sequence[int] = "size", sample: Any = None,
    optimizer: str | float | None = "adam",
) -> Plan:
    """Balance the units of ``model`` over ``devices`` (as ``build_plan`` does for layers)."""
    factor = optimizer_factor(optimizer)
    if isinstance(balance, str) and balance not in ("size", "time"):
        raise InvalidValueError(f"balance {balance!r} is unknown; use 'size', 'time' or a list of unit counts")
    timed = balance == "time"
    if timed and (sample is None or any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))):
        raise SplitError("balance='time' needs real parameters and a real sample to time; pass sample=... "
                         "or use balance='size' (works on the meta device)")
    measured = unit_costs(model, sample, measure_time=timed, at_least=len(devices))
    sequence, costs, followers, ties = measured.sequence, measured.costs, measured.followers, measured.ties
    reasons: list[str] = []
    if isinstance(balance, str):
        if len(devices) > len(sequence):
            tied = [measured.tie_of(name) for name, _ in sequence if measured.group_ties.get(name)]
            why = f" (tied units stay on one device: {'; '.join(tied)})" if tied else ""
            raise SplitError(f"cannot cut {len(sequence)} unit(s) of {type(model).__name__} into {len(devices)} "
                             f"parts{why}; pass at most {len(sequence)} devices")
        weights = ([c.seconds or 0.0 for c in costs] if timed
                   else [c.memory(training=True, optimizer=factor) for c in costs])
        counts = balance_cost(weights, len(devices))
        if sample is None:
            reasons.append("no sample given: activations are not counted and units are in the order they are "
                           "registered; pass sample=<a batch> to run them in the order they run")
    else:
        counts = check_counts(balance, len(sequence), len(devices), what="unit")
    joined = "; tied units join the first one" if len(sequence) < len(measured.units) else ""
    reasons.append(f"{len(sequence)} units (submodules, in the order they run{joined}) "
                   f"cut into {len(devices)} parts: {counts}")
    plan = plan_from_counts(sequence, costs, devices, counts, basis=balance if isinstance(balance, str) else "given",
                            optimizer=factor, reasons=reasons)
    if timed:
        plan = replace(plan, memory_basis=plan.memory_basis + "; time: each unit's forward on the sample")
    return finish_plan(plan, followers, ties, measured.units, measured.repeats)


