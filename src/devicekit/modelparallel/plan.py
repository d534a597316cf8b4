"""Plan where a model goes: how many devices, which layers on which, within memory budgets.

Given budgets per device (or, by default, the free memory the inventory reports minus a
headroom, plus the host's available RAM), :func:`plan_devices` picks the fewest GPUs whose
budgets hold the model, balances its units over them (an ``nn.Sequential``'s layers, any other
module's submodules; tied units together, wherever they are), and offloads the tail to the CPU
only when the GPUs cannot hold it all. Unlike accelerate's ``infer_auto_device_map`` it:

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
from typing import Any

import torch
from torch import nn

from devicekit.errors import InvalidValueError
from devicekit.modelparallel.budget_fit import Budget
from devicekit.modelparallel.device_list import parse_device
from devicekit.modelparallel.layer_profile import optimizer_factor
from devicekit.modelparallel.module_plan import plan_module_budgets
from devicekit.modelparallel.partition import Plan
from devicekit.units import format_size, parse_size

__all__ = ["plan_devices", "Budget", "default_budgets"]


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
    # any module, an nn.Sequential included: its units (submodules), in the order they run
    return plan_module_budgets(model, budgets, sample, factor=factor, training=training, spread=spread)


