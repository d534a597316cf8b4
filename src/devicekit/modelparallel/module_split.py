"""Split any ``nn.Module`` over devices at submodule boundaries (what ``dk.split`` does for non-Sequential models).

The seeds' hand-written version (``self.sub_network1.cuda(0)``, ``x = x.cuda(1)`` in
``forward``), done for a model as it is: its units (submodules; see
:mod:`~devicekit.modelparallel.module_units`) are found in the order they run on ``sample``,
cut into consecutive balanced groups (the same ``balance`` options and printable
:class:`~devicekit.modelparallel.partition.Plan` as an ``nn.Sequential``), and each unit is
moved to its device. A hook moves each unit's inputs to its device; outputs stay where they are
produced, so autograd carries gradients back; ops in a parent's own ``forward`` that meet
tensors from two devices are handled by :mod:`~devicekit.modelparallel.device_flow`. Units that
share parameters (tied embeddings) stay on one device, and the plan says where.

Usage::

    import devicekit as dk

    split = dk.split(Net(), ["cuda:0", "cuda:1"], sample=x)   # any nn.Module
    out = split(x)                # same result and gradients as Net()(x)
    print(split.plan)             # units per device, memory, tied parameters
    split.module                  # the original model (its parameters moved, nothing copied)
    plain = split.unsplit()       # hooks removed: the model, with its parameters where they are
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from devicekit.errors import InvalidValueError, SplitError
from devicekit.modelparallel.balance import balance_cost
from devicekit.modelparallel.device_flow import DeviceFlow
from devicekit.modelparallel.layer_profile import LayerCost, optimizer_factor
from devicekit.modelparallel.module_units import (
    Unit,
    find_units,
    own_tensors,
    tie_groups,
    trace_units,
)
from devicekit.modelparallel.partition import Plan
from devicekit.modelparallel.stays import StaysOnPlan

__all__ = ["ModuleSplit", "split_module", "plan_module", "unit_costs"]

_SPLIT_ATTR = "_devicekit_split_devices"


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


def unit_costs(
    model: nn.Module, sample: Any, *, measure_time: bool = False, opened: frozenset[str] = frozenset(),
    at_least: int = 1,
) -> Measured:
    """Find, trace and group the units of ``model``; a module opened into children that never
    run (its forward uses their weights directly, as ``nn.MultiheadAttention`` does) is closed."""
    from devicekit.modelparallel.pipeline import Pipeline
    from devicekit.modelparallel.split import SplitModel

    if getattr(model, _SPLIT_ATTR, None) is not None or isinstance(model, (ModuleSplit, SplitModel, Pipeline)):
        raise SplitError(f"model {type(model).__name__} is already split; call .unsplit() on the split "
                         "model first, then split it again")
    if isinstance(model, (nn.ModuleList, nn.ModuleDict)):
        raise SplitError(f"model is an nn.{type(model).__name__}, which has no forward and no order of "
                         "execution; if its children run one after another, pass nn.Sequential(*model_list)")
    sealed: frozenset[str] = frozenset()
    while True:
        units, now = find_units(model, opened=opened, at_least=at_least, sealed=sealed)
        costs, order, called = trace_units(model, units, sample, measure_time=measure_time)
        idle = set()
        for i, unit in enumerate(units):  # close the innermost opened module of a unit that never ran
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
    return Measured(units, sequence, merged, followers, [f"{a} = {b}" for a, b in ties], now, sealed)


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


def finish_plan(plan: Plan, followers: dict[str, list[str]], ties: list[str], units: Sequence[Unit] = ()) -> Plan:
    """Add tied followers to their anchors' parts; name where tied tensors and the tensors of
    opened parents (a model's own positional embedding) live."""
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
    return replace(plan, parts=parts, tied=lines, reasons=reasons)


def plan_module(
    model: nn.Module, devices: list[torch.device], *, balance: str | Sequence[int] = "size", sample: Any = None,
    optimizer: str | float | None = "adam",
) -> Plan:
    """Balance the units of ``model`` over ``devices`` (as ``build_plan`` does for layers)."""
    from devicekit.modelparallel.split import check_counts, plan_from_counts

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
            raise SplitError(f"cannot cut {len(sequence)} unit(s) of {type(model).__name__} into {len(devices)} "
                             f"parts; pass at most {len(sequence)} devices")
        weights = ([c.seconds or 0.0 for c in costs] if timed
                   else [c.memory(training=True, optimizer=factor) for c in costs])
        counts = balance_cost(weights, len(devices))
        if sample is None:
            reasons.append("no sample given: activations are not counted and units are in the order they are "
                           "registered; pass sample=<a batch> to run them in the order they run")
    else:
        counts = check_counts(balance, len(sequence), len(devices))
    reasons.append(f"{len(sequence)} units (submodules, in the order they run) cut into {len(devices)} "
                   f"consecutive parts: {counts}")
    plan = plan_from_counts(sequence, costs, devices, counts, basis=balance if isinstance(balance, str) else "given",
                            optimizer=factor, reasons=reasons)
    if timed:
        plan = replace(plan, memory_basis=plan.memory_basis + "; time: each unit's forward on the sample")
    return finish_plan(plan, followers, ties, measured.units)


def _placement(model: nn.Module, plan: Plan) -> tuple[list[tuple[str, nn.Module, torch.device]],
                                                       list[tuple[nn.Module, torch.device]]]:
    """Units with their devices, and opened parents with the device their own tensors go to."""
    units = []
    for part in plan.parts:
        for name in (*part.layer_names, *part.tied_names):
            try:
                module = model.get_submodule(name)
            except AttributeError:
                raise SplitError(f"the plan places {name!r} but model {type(model).__name__} has no such "
                                 "submodule; plan this model") from None
            units.append((name, module, part.device))
    placed = {id(m) for _, m, _ in units}
    parents: dict[str, tuple[nn.Module, torch.device]] = {}
    for name, _, device in units:
        pieces = name.split(".")
        for k in range(len(pieces)):
            parents.setdefault(".".join(pieces[:k]), (model.get_submodule(".".join(pieces[:k])), device))
    for pname, (parent, _) in parents.items():
        for cname, child in parent.named_children():
            full = f"{pname}.{cname}" if pname else cname
            if id(child) not in placed and full not in parents:
                raise SplitError(f"the plan does not place submodule {full!r} of {type(model).__name__}; "
                                 "plan this model")
    return units, [(m, d) for m, d in parents.values()]


def _check_ties(units: list[tuple[str, nn.Module, torch.device]], parents: list[tuple[nn.Module, torch.device]]) -> None:
    where: dict[int, tuple[str, torch.device]] = {}
    tensors = [(f"{n}.{t}", p, d) for n, m, d in units for t, p in (*m.named_parameters(), *m.named_buffers())]
    tensors += [(tname, p, d) for m, d in parents for tname, p in own_tensors(m, "")]
    for name, tensor, device in tensors:
        first = where.setdefault(id(tensor), (name, device))
        if first[1] != device:
            raise SplitError(f"{name} is the same tensor as {first[0]} but the plan puts them on {device} and "
                             f"{first[1]}; tied parameters must share a device: plan this model")


class ModuleSplit(StaysOnPlan):
    """Any model whose submodules live on different devices; call it as the model itself.

    ``module`` is the original model (same parameter objects; ``module.state_dict()`` has the
    original keys), ``plan`` says where each unit went, ``devices`` the device of each part.
    """

    split_again = "dk.split(split.unsplit(), [...])"

    def __init__(self, module: nn.Module, plan: Plan) -> None:
        super().__init__()
        self.module = module
        self.plan = plan
        units, parents = _placement(module, plan)
        _check_ties(units, parents)
        for name, unit, device in units:
            if device.type != "meta" and any(t.device.type == "meta" for t in (*unit.parameters(), *unit.buffers())):
                raise SplitError(f"unit {name!r} has parameters on the meta device and cannot move to {device}; "
                                 "use dk.plan_devices on the meta model, then build the real model and split it")
        for parent, device in parents:
            parent._apply(lambda t, d=device: t.to(d), recurse=False)
        for _, unit, device in units:
            unit.to(device)
        self._flow = DeviceFlow(plan.devices[0])
        self._handles = [h for _, unit, device in units for h in self._flow.attach(unit, device)]
        setattr(module, _SPLIT_ATTR, [str(d) for d in plan.devices])

    @property
    def devices(self) -> list[torch.device]:
        return self.plan.devices

    @property
    def mixed_moves(self) -> int:
        """Ops in the parents' own code whose arguments were moved to one device so far."""
        return self._flow.mode.moves

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._flow:
            return self.module(*args, **kwargs)

    def unsplit(self) -> nn.Module:
        """Remove the hooks; return the model (its parameters stay where the plan put them)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if hasattr(self.module, _SPLIT_ATTR):
            delattr(self.module, _SPLIT_ATTR)
        return self.module

    def extra_repr(self) -> str:
        return f"devices={[str(d) for d in self.devices]}, counts={self.plan.counts}"


def split_module(
    model: nn.Module, devices: list[torch.device] | Plan, *, balance: str | Sequence[int] = "size",
    sample: Any = None, optimizer: str | float | None = "adam",
) -> ModuleSplit:
    """Plan (unless ``devices`` is a Plan) and place ``model``; see the module doc."""
    plan = devices if isinstance(devices, Plan) else plan_module(
        model, devices, balance=balance, sample=sample, optimizer=optimizer)
    return ModuleSplit(model, plan)
