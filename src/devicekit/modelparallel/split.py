"""Split a model into parts on several devices (model parallelism): ``dk.split``.

What the seeds do by hand (``sub_network1.cuda(0)``, ``x = x.cuda(1)`` inside ``forward``),
done for any model, with one path for every kind of model: the model's units (submodules; for
an ``nn.Sequential`` its layers, nested plain Sequentials opened) are measured in the order they
run (:mod:`~devicekit.modelparallel.unit_plan`), balanced over the devices, and placed
(:mod:`~devicekit.modelparallel.module_split`): hooks move each unit's inputs to its device,
outputs stay where they are produced, so autograd carries gradients back across devices.
Devices may repeat and may be ``"cpu"`` (offload).

* Units that share a parameter or buffer (tied weights) are kept on one device, wherever they
  are in the model: ``layer3`` tied to ``layer1`` joins ``layer1``'s device even when ``layer2``
  runs elsewhere between them (a device map need not be consecutive). The plan says so.
* An ``nn.Sequential`` and the same layers inside a custom module plan and run the same way;
  the Sequential's split is a :class:`SplitModel` (a :class:`ModuleSplit` that also offers
  ``.parts``, what each device holds).
* A split model stays where it was planned: ``.to(device)``, ``.cuda()`` and ``.cpu()`` are
  refused (dtype casts are fine); ``.unsplit()`` and split again to move it.
* A pipeline needs more: its parts run one after another, so each must be consecutive layers
  (:mod:`~devicekit.modelparallel.layer_plan`, which refuses a tie it cannot keep in one part).

Usage::

    import torch
    from torch import nn
    import devicekit as dk

    model = dk.split(Net(), ["cuda:0", "cuda:1"])          # the seeds' Net, in one line
    model = dk.split(GPT(), ["cuda:0", "cuda:1"], sample=tokens)   # tied head kept with the embedding
    seq = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10))
    seq = dk.split(seq, ["cuda:0", "cuda:1"], sample=torch.randn(64, 1024))
    print(seq.plan)                   # parts, units, parameters, memory, balance, ties
    dk.split(seq.unsplit(), ["cuda:0", "cpu"], balance=[2, 1])   # explicit counts, CPU offload
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from devicekit.errors import SplitError
from devicekit.modelparallel.device_list import parse_devices
from devicekit.modelparallel.layer_plan import Balance, build_plan, make_parts, resolve
from devicekit.modelparallel.layer_profile import sequential_layers
from devicekit.modelparallel.microbatch import move
from devicekit.modelparallel.module_split import ModuleSplit
from devicekit.modelparallel.module_units import is_plain_sequential
from devicekit.modelparallel.partition import Plan, check_counts
from devicekit.modelparallel.stays import StaysOnPlan
from devicekit.modelparallel.unit_plan import plan_module

# Balance, build_plan, check_counts, make_parts, resolve, StaysOnPlan: their homes are
# layer_plan, partition and stays; still importable from here, where they used to live.
__all__ = ["split", "SplitModel", "ModuleSplit", "StaysOnPlan", "Balance", "build_plan", "check_counts",
           "make_parts", "resolve"]


class SplitModel(ModuleSplit):
    """An ``nn.Sequential`` split over devices: a :class:`ModuleSplit` whose units are its layers.

    ``module`` is the original Sequential (same parameters; state_dict keys with a ``module.``
    prefix), ``plan`` says where each layer went, ``parts`` what each device holds."""

    split_again = "dk.split(model.unsplit(), [...])"

    def __init__(self, module: nn.Module, plan: Plan) -> None:
        route = _route(module, plan)
        super().__init__(module, plan, hooks=route is None)
        #: (layer, device) in run order when every layer is placed whole: the forward moves each
        #: layer's input itself, without hooks or the parent-code mode (a Sequential has no
        #: code of its own); None when the plan opened a layer (then the hooks place its pieces)
        self._route = route

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._route is None or kwargs or len(args) != 1:
            return super().forward(*args, **kwargs)
        x = args[0]
        for layer, device in self._route:
            x = layer(move(x, device))
        return x

    @property
    def parts(self) -> list[nn.Sequential]:
        """Per part, its layers (tied followers last) as an ``nn.Sequential`` on the part's device.

        These are views for inspection and per-device bookkeeping (parameters, memory): run the
        split model itself, since a part's layers need not be consecutive in the model."""
        out = []
        for part in self.plan.parts:
            names = (*part.layer_names, *part.tied_names)
            out.append(nn.Sequential(OrderedDict(
                (name.replace(".", "_"), self.module.get_submodule(name)) for name in names)))
        return out


def _route(module: nn.Module, plan: Plan) -> list[tuple[nn.Module, torch.device]] | None:
    """Each layer of the Sequential with its planned device, or None if a layer is not placed whole."""
    where = {name: part.device for part in plan.parts for name in (*part.layer_names, *part.tied_names)}
    placed: dict[int, torch.device] = {}
    route = []
    for name, layer in sequential_layers(module):
        device = where.get(name) or placed.get(id(layer))  # a layer listed again runs where it lives
        if device is None:
            return None
        placed[id(layer)] = device
        route.append((layer, device))
    return route


def split(
    model: nn.Module,
    devices: Sequence[Any] | Plan,
    *,
    balance: Balance = "size",
    sample: Any = None,
    optimizer: str | float | None = "adam",
) -> ModuleSplit:
    """Cut ``model`` into parts on ``devices``; return the split model (see the module doc).

    ``devices``: a list (repeats and ``"cpu"`` allowed) or a :class:`Plan` from
    ``dk.plan_devices``. ``balance``: ``"size"`` (weights, grads, ``optimizer`` state and, with
    a ``sample``, saved activations), ``"time"`` (each unit's forward, timed on ``sample``) or
    a list of unit counts (tied units count once, with the first one). The parameters move; the
    model object is reused, not copied. A plain ``nn.Sequential`` gives a :class:`SplitModel`.
    """
    plain = is_plain_sequential(model)
    if plain and len(model) == 0:
        raise SplitError("model nn.Sequential() has no layers; there is nothing to split")
    if isinstance(devices, Plan):
        parse_devices(devices.devices)  # a plan made for GPUs this process cannot see is refused here
        plan = devices
    else:
        plan = plan_module(model, parse_devices(devices), balance=balance, sample=sample, optimizer=optimizer)
    return (SplitModel if plain else ModuleSplit)(model, plan)
