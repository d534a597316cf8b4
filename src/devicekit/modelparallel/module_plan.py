"""``dk.plan_devices`` for any ``nn.Module`` (``nn.Sequential`` too): its units within budgets, opened where too big.

The units of the model (see :mod:`~devicekit.modelparallel.module_units`) are measured on the
sample (on the meta device if the model lives there: no real memory), tied units grouped
(:mod:`~devicekit.modelparallel.unit_plan`), and the groups handed to the budget fitting
(:mod:`~devicekit.modelparallel.budget_fit`). A unit bigger than every device's budget is opened into its
submodules and the model is measured again; a unit that cannot be opened (no submodules) and
fits nowhere is refused, naming it, the tie that holds it to other units, and the ways out.

Usage::

    with torch.device("meta"):
        model = GPT()
    plan = dk.plan_devices(model, {"cuda:0": "20GiB", "cuda:1": "20GiB"},
                           sample=torch.empty(8, 128, dtype=torch.long, device="meta"))
    split = dk.split(GPT(), plan)
"""

from __future__ import annotations

from typing import Any

from torch import nn

from devicekit.errors import SplitError
from devicekit.modelparallel.budget_fit import Budget, plan_costs
from devicekit.modelparallel.partition import Plan
from devicekit.modelparallel.unit_plan import finish_plan, unit_costs
from devicekit.units import format_size

__all__ = ["plan_module_budgets"]


def plan_module_budgets(model: nn.Module, budgets: list[Budget], sample: Any, *, factor: float,
                        training: bool, spread: bool) -> Plan:
    """The plan for ``model``'s units within ``budgets`` (see the module doc)."""
    opened: frozenset[str] = frozenset()
    while True:
        measured = unit_costs(model, sample, opened=opened)
        sequence, costs, followers, ties = measured.sequence, measured.costs, measured.followers, measured.ties
        sizes = [c.memory(training=training, optimizer=factor) for c in costs]
        working = max((c.transient_bytes for c in costs), default=0)
        room = max((b.usable for b in budgets), default=0) - working
        big = [i for i, size in enumerate(sizes) if size > room]
        if not big:
            break
        openable = {n for i in big for n in (sequence[i][0], *followers.get(sequence[i][0], []))
                    if any(True for _ in model.get_submodule(n).children())}
        if openable - measured.opened - measured.sealed:
            opened = measured.opened | openable
            continue
        worst = max(big, key=lambda i: sizes[i])
        name = sequence[worst][0]
        members = followers.get(name, [])
        what = "training" if training else "inference"
        best = max(budgets, key=lambda b: b.usable)
        why = ("its forward uses its submodules' weights directly" if name in measured.sealed
               else "it has no submodules that run on their own")
        tied = f" (tied: {measured.tie_of(name)}, so they stay on one device)" if members else ""
        raise SplitError(
            f"unit {name!r} ({type(sequence[worst][1]).__name__}){tied} needs {format_size(sizes[worst])} for "
            f"{what} plus {format_size(working)} of working space (the largest unit's input and output), but the "
            f"largest budget is {format_size(best.usable)} on {best.device}, and it cannot be cut further "
            f"({why}); add a device with more memory, offload to the CPU (add 'cpu' to max_memory), "
            "use training=False or a smaller batch"
        )
    plan = plan_costs(sequence, costs, budgets, sample_given=sample is not None, factor=factor,
                      training=training, spread=spread,
                      tied={name: measured.tie_of(name) for name in measured.group_ties})
    groups = f" in {len(sequence)} tie groups" if len(sequence) < len(measured.units) else ""
    plan.reasons.append(f"units: {len(measured.units)} submodules of {type(model).__name__}{groups}"
                        + (", in the order they run on the sample" if sample is not None
                           else ", in the order they are registered"))
    return finish_plan(plan, followers, ties, measured.units, measured.repeats)
