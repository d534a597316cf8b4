"""Place any ``nn.Module`` over devices at submodule boundaries: what ``dk.split`` does, for every model.

The seeds' hand-written version (``self.sub_network1.cuda(0)``, ``x = x.cuda(1)`` in
``forward``), done for a model as it is: its units (submodules; see
:mod:`~devicekit.modelparallel.module_units`) are found in the order they run on ``sample``,
cut into balanced groups in run order (:mod:`~devicekit.modelparallel.unit_plan`; an
``nn.Sequential``'s units are its layers), and each unit is moved to its device. A hook
moves each unit's inputs to its device; outputs stay where they are produced, so autograd carries gradients back; ops in a parent's own ``forward`` that meet
tensors from two devices are handled by :mod:`~devicekit.modelparallel.device_flow`. Units that
share parameters (tied embeddings) stay on one device even when other units run between them
(the device map need not be consecutive), and the plan says where.

Usage::

    import devicekit as dk

    split = dk.split(Net(), ["cuda:0", "cuda:1"], sample=x)   # any nn.Module
    out = split(x)                # same result and gradients as Net()(x)
    print(split.plan)             # units per device, memory, tied parameters
    split.module                  # the original model (its parameters moved, nothing copied)
    plain = split.unsplit()       # hooks removed: the model, with its parameters where they are
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from devicekit.errors import SplitError
from devicekit.modelparallel.device_flow import DeviceFlow
from devicekit.modelparallel.module_units import own_tensors
from devicekit.modelparallel.partition import Plan
from devicekit.modelparallel.stays import SPLIT_ATTR, StaysOnPlan

__all__ = ["ModuleSplit"]


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
            raise SplitError(f"'{name}' is the same tensor as '{first[0]}' (tied), but the plan puts them on "
                             f"{device} and {first[1]}; tied parameters must share a device: plan this model")


class ModuleSplit(StaysOnPlan):
    """Any model whose submodules live on different devices; call it as the model itself.

    ``module`` is the original model (same parameter objects; ``module.state_dict()`` has the
    original keys), ``plan`` says where each unit went, ``devices`` the device of each part.
    """

    split_again = "dk.split(split.unsplit(), [...])"

    def __init__(self, module: nn.Module, plan: Plan, *, hooks: bool = True) -> None:
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
        # hooks=False: the caller moves each unit's input itself (SplitModel's plain Sequential)
        self._handles = [h for _, unit, device in units for h in self._flow.attach(unit, device)] if hooks else []
        setattr(module, SPLIT_ATTR, [str(d) for d in plan.devices])

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
        if hasattr(self.module, SPLIT_ATTR):
            delattr(self.module, SPLIT_ATTR)
        return self.module

    def extra_repr(self) -> str:
        return f"devices={[str(d) for d in self.devices]}, counts={self.plan.counts}"

