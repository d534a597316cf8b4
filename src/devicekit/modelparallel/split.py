"""Split a model into consecutive parts on several devices (model parallelism).

What the seeds do by hand (``sub_network1.cuda(0)``, ``x = x.cuda(1)`` inside ``forward``),
done for any model: the model is cut into balanced consecutive parts, each part is moved to its
device, and activations are moved from part to part, so autograd carries gradients back across
devices. Devices may repeat and may be ``"cpu"`` (offload).

* An ``nn.Sequential`` (this module: :class:`SplitModel`) is cut between its layers; input goes
  in on the first device, output comes out on the last.
* Any other ``nn.Module`` (:mod:`~devicekit.modelparallel.module_split`: ``ModuleSplit``) is cut
  between its submodules in the order they run on ``sample``; hooks move each submodule's inputs
  to its device, ops in the parents' own ``forward`` that meet two devices are joined, tied
  parameters keep their modules on one device.
* A layer object listed twice runs twice, and layers or modules that share a parameter (tied
  weights) are kept on one device (the plan says so; :mod:`devicekit.modelparallel.sharing`).
* A split model stays where it was planned: ``.to(device)``, ``.cuda()`` and ``.cpu()`` are
  refused (dtype casts are fine); split again to move it.

Usage::

    import torch
    from torch import nn
    import devicekit as dk

    model = dk.split(Net(), ["cuda:0", "cuda:1"])          # the seeds' Net, in one line
    model = dk.split(GPT(), ["cuda:0", "cuda:1"], sample=tokens)   # any module; tied head kept
    seq = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10))
    seq = dk.split(seq, ["cuda:0", "cuda:1"], sample=torch.randn(64, 1024))
    print(seq.plan)                   # parts, layers, parameters, memory, balance
    dk.split(seq.module, ["cuda:0", "cpu"], balance=[2, 1])   # explicit layer counts, CPU offload
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from devicekit.errors import InvalidValueError, SplitError
from devicekit.modelparallel.balance import balance_cost
from devicekit.modelparallel.device_list import parse_devices
from devicekit.modelparallel.layer_profile import (
    LayerCost,
    optimizer_factor,
    profile_layers,
    sequential_layers,
)
from devicekit.modelparallel.microbatch import move
from devicekit.modelparallel.partition import Part, Plan
from devicekit.modelparallel.sharing import (
    Span,
    block_costs,
    blocks,
    check_cuts,
    expand_counts,
    find_spans,
    must_keep_together,
)
from devicekit.modelparallel.stays import StaysOnPlan

if TYPE_CHECKING:
    from devicekit.modelparallel.module_split import ModuleSplit

__all__ = ["split", "SplitModel", "StaysOnPlan", "build_plan", "check_counts", "make_parts"]

Balance = str | Sequence[int]


def check_counts(counts: Any, layers: int, parts: int) -> list[int]:
    """Validate explicit layer counts: ``parts`` positive ints summing to ``layers``."""
    try:
        values = [int(c) for c in counts]
    except (TypeError, ValueError):
        raise InvalidValueError(f"balance {counts!r} is not a list of layer counts; e.g. [3, 2]") from None
    if any(isinstance(c, bool) for c in counts) or any(v < 1 for v in values):
        raise InvalidValueError(f"balance {counts!r} must hold positive layer counts, one per device")
    if len(values) != parts:
        raise InvalidValueError(f"balance {counts!r} has {len(values)} entries for {parts} device(s); give one per device")
    if sum(values) != layers:
        raise InvalidValueError(f"balance {counts!r} sums to {sum(values)} but the model has {layers} layers")
    return values


def build_plan(
    layers: list[tuple[str, nn.Module]],
    devices: list[torch.device],
    *,
    balance: Balance = "size",
    sample: Any = None,
    optimizer: str | float | None = "adam",
    separate: bool = False,
) -> Plan:
    """Measure the layers and cut them into ``len(devices)`` balanced parts.

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
                f"{widest.what}, so layers {widest.first}..{widest.last} must stay on one device; "
                f"the rest cannot fill {len(devices)} parts: pass at most {len(runs)} devices or untie it"
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


def plan_from_counts(
    layers: list[tuple[str, nn.Module]],
    costs: list[LayerCost],
    devices: Sequence[torch.device],
    counts: Sequence[int],
    *,
    basis: str,
    optimizer: float,
    training: bool = True,
    reasons: list[str] | None = None,
    budgets: Sequence[int | None] | None = None,
) -> Plan:
    """A :class:`Plan` from layer counts per device (zero-count devices are left out)."""
    parts: list[Part] = []
    start = 0
    for i, (device, count) in enumerate(zip(devices, counts, strict=True)):
        if count == 0:
            continue
        chunk = costs[start:start + count]
        seconds = [c.seconds for c in chunk]
        memory = sum(c.memory(training=training, optimizer=optimizer) for c in chunk)
        memory += max((c.transient_bytes for c in chunk), default=0)  # peak working set
        parts.append(Part(
            index=len(parts), device=device, start=start, stop=start + count,
            layer_names=tuple(name for name, _ in layers[start:start + count]),
            parameters=sum(c.parameters for c in chunk), memory=int(memory),
            seconds=None if any(s is None for s in seconds) else float(sum(s or 0.0 for s in seconds)),
            budget=None if budgets is None else budgets[i],
        ))
        start += count
    if training:
        what = (f"training, optimizer state = {optimizer:g}x weights: weights + grads + state + saved "
                "activations + the largest layer's input and output")
    else:
        what = "inference: weights + buffers + the largest layer's input and output"
    return Plan(parts=parts, basis=basis, memory_basis=what, reasons=list(reasons or []))


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


class SplitModel(StaysOnPlan):
    split_again = "dk.split(model.module, [...])"

    """A sequential model whose parts live on different devices; ``forward`` hands activations on.

    ``module`` is the original model (same parameters, same state_dict keys with a ``module.``
    prefix); ``parts`` are its consecutive slices, ``plan`` says where each one went.
    """

    def __init__(self, module: nn.Module, parts: list[nn.Sequential], plan: Plan) -> None:
        super().__init__()
        self.module = module
        self._parts = parts
        self.plan = plan

    @property
    def parts(self) -> list[nn.Sequential]:
        return list(self._parts)

    @property
    def devices(self) -> list[torch.device]:
        return self.plan.devices

    def forward(self, x: Any) -> Any:
        for device, part in zip(self.plan.devices, self._parts, strict=True):
            x = part(move(x, device))
        return x

    def extra_repr(self) -> str:
        return f"devices={[str(d) for d in self.devices]}, counts={self.plan.counts}"


def resolve(
    model: nn.Module, devices: Any, balance: Balance, sample: Any, optimizer: str | float | None,
    *, separate: bool = False,
) -> tuple[list[tuple[str, nn.Module]], Plan]:
    """The layers of ``model`` and the plan for ``devices`` (a device list or a ready Plan).

    ``separate``: each part runs in its own process, so shared objects must stay in one part."""
    layers = sequential_layers(model)
    if isinstance(devices, Plan):
        counts = devices.counts
        if sum(counts) != len(layers):
            raise SplitError(f"plan covers {sum(counts)} layers but the model has {len(layers)}; plan this model")
        parse_devices(devices.devices)  # a plan made for GPUs this process cannot see is refused here
        spans = find_spans(layers)
        if spans and must_keep_together(devices.devices, separate=separate):
            check_cuts(spans, counts, devices.devices, separate=separate)
        return layers, devices
    return layers, build_plan(layers, parse_devices(devices), balance=balance, sample=sample,
                              optimizer=optimizer, separate=separate)


def split(
    model: nn.Module,
    devices: Sequence[Any] | Plan,
    *,
    balance: Balance = "size",
    sample: Any = None,
    optimizer: str | float | None = "adam",
) -> SplitModel | ModuleSplit:
    """Cut ``model`` into parts on ``devices``; return the split model.

    An ``nn.Sequential`` is cut between its layers (a :class:`SplitModel`); any other module
    between its submodules, in the order they run on ``sample`` (a
    :class:`~devicekit.modelparallel.module_split.ModuleSplit`).

    ``devices``: a list (repeats and ``"cpu"`` allowed) or a :class:`Plan` from
    ``dk.plan_devices``. ``balance``: ``"size"`` (weights, grads, ``optimizer`` state and, with
    a ``sample``, saved activations), ``"time"`` (forward+backward per layer on ``sample``) or
    a list of layer counts. The parameters move; the model object is reused, not copied.
    """
    if not isinstance(model, nn.Sequential) or type(model).forward is not nn.Sequential.forward:
        from devicekit.modelparallel.module_split import split_module

        if not isinstance(devices, Plan):
            devices = parse_devices(devices)
        else:
            parse_devices(devices.devices)  # a plan made for GPUs this process cannot see is refused here
        return split_module(model, devices, balance=balance, sample=sample, optimizer=optimizer)
    layers, plan = resolve(model, devices, balance, sample, optimizer)
    return SplitModel(model, make_parts(layers, plan), plan)
