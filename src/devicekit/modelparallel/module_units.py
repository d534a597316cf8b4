"""The units of any ``nn.Module``: the submodules a split places, in the order they run, and their cost.

A unit is a submodule placed whole on one device. Containers (``nn.ModuleList``,
``nn.ModuleDict``, plain ``nn.Sequential``) are opened, so a transformer's ``blocks`` become
``blocks.0``, ``blocks.1``, ...; any other child is one unit (a ResNet block, an attention
layer), and is opened further only when there are more devices than units or when it alone is
too big for every budget. The tensors a parent module owns itself (a positional embedding
``nn.Parameter`` on the top model) go with its first unit. Units that share a parameter or a
buffer (tied input/output embeddings) form one group that lives on one device.

Running ``sample`` through the model once with hooks gives the order in which the units run
(a unit never called keeps its place at the end) and, per unit, the activations autograd saves,
its input + output bytes and (``measure_time``) its forward time. The run needs no real memory
when the model or the sample is on the meta device, and leaves the model as it was (buffers,
training flags, RNG).

Usage::

    from devicekit.modelparallel.module_units import find_units, trace_units

    units = find_units(model)                        # [Unit('embed'), Unit('blocks.0'), ...]
    costs, order, called = trace_units(model, units, sample)  # LayerCost per unit, run order, calls per unit
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from devicekit.errors import SplitError
from devicekit.modelparallel.call_args import as_call
from devicekit.modelparallel.layer_profile import LayerCost
from devicekit.placement.walk import map_tensors

__all__ = ["Unit", "find_units", "trace_units", "tie_groups", "group_count", "is_plain_sequential", "own_tensors"]


@dataclass
class Unit:
    """One submodule placed whole, plus the tensors of parents that travel with it."""

    name: str
    module: nn.Module
    #: (qualified name, tensor) of parameters/buffers owned by opened parents, placed with this unit
    extras: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        prefix = f"{self.name}." if self.name else ""
        for name, t in self.module.named_parameters(remove_duplicate=False):
            yield prefix + name, t
        for name, t in self.module.named_buffers(remove_duplicate=False):
            yield prefix + name, t
        yield from self.extras


def is_plain_sequential(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _is_container(module: nn.Module) -> bool:
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) or is_plain_sequential(module)


def own_tensors(module: nn.Module, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """The parameters and buffers ``module`` holds itself (not its children's)."""
    found = [(f"{prefix}{n}", t) for n, t in module._parameters.items() if t is not None]
    return found + [(f"{prefix}{n}", t) for n, t in module._buffers.items() if t is not None]


def find_units(
    model: nn.Module, *, opened: frozenset[str] = frozenset(), at_least: int = 1,
    sealed: frozenset[str] = frozenset(),
) -> tuple[list[Unit], frozenset[str]]:
    """The units of ``model`` in registration order, and the names of the modules opened.

    ``opened`` names modules to open further, ``sealed`` modules never to open (their forward
    uses their children's weights directly). With fewer than ``at_least`` placeable groups (units
    that share a tensor count once: a tied embedding and head are one group), the largest unit
    that has children is opened, until there are enough or none can be opened. Opening never
    lowers the group count, so the count this stops at for ``k`` is reached for any smaller ``k``.
    """
    if not any(True for _ in model.children()):
        raise SplitError(
            f"model {type(model).__name__} has no submodules to place on different devices; "
            "put it on one device with .to(device), or split a model made of submodules"
        )
    now = set(opened) - set(sealed)
    while True:
        units = _walk(model, now)
        if group_count(units) >= at_least:
            return units, frozenset(now)
        closed = [u for u in units if u.name not in sealed and any(True for _ in u.module.children())]
        if not closed:
            return units, frozenset(now)
        biggest = max(closed, key=lambda u: sum(t.numel() for _, t in u.tensors()))
        now.add(biggest.name)


def _walk(model: nn.Module, opened: set[str]) -> list[Unit]:
    units: list[Unit] = []
    seen: set[int] = set()
    parents: list[tuple[str, nn.Module, int]] = []  # (prefix, module, index of its first unit)

    def visit(module: nn.Module, prefix: str) -> None:
        parents.append((prefix, module, len(units)))
        for name, child in module.named_children():
            if id(child) in seen:
                continue  # one module object registered twice is one unit
            seen.add(id(child))
            full = f"{prefix}{name}"
            has_children = any(True for _ in child.children())
            if has_children and (_is_container(child) or full in opened):
                visit(child, f"{full}.")
            else:
                units.append(Unit(full, child))

    seen.add(id(model))
    visit(model, "")
    for prefix, module, first in parents:
        tensors = own_tensors(module, prefix)
        if tensors:
            units[min(first, len(units) - 1)].extras.extend(tensors)
    return units


def group_count(units: list[Unit]) -> int:
    """How many groups ``units`` form once units that share a tensor are merged."""
    return len(set(tie_groups(units)[0])) if len(units) > 1 else len(units)


def tie_groups(units: list[Unit]) -> tuple[list[int], list[tuple[str, str, int]]]:
    """Union of units sharing a tensor: ``root[i]`` per unit, and per tie (name, other name,
    index of the unit holding ``name``)."""
    root = list(range(len(units)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    owner: dict[int, tuple[int, str]] = {}
    ties: list[tuple[str, str, int]] = []
    for i, unit in enumerate(units):
        for name, tensor in unit.tensors():
            first = owner.setdefault(id(tensor), (i, name))
            if first[0] != i:
                ties.append((name, first[1], i))
                a, b = find(i), find(first[0])
                root[max(a, b)] = min(a, b)
    return [find(i) for i in range(len(units))], ties


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(obj, lambda t: found.append(t) or t)
    return found


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "meta" else torch.empty_like(t, device="meta")


def _prepare_run(model: nn.Module, sample: Any) -> tuple[Any, set[int]]:
    """A call running ``sample`` through ``model`` (on the meta device when model or sample is
    there, else for real) and the ids of the weights it uses (not counted as activations).
    A keyword batch (a dict of the forward's argument names, or a ``Call``) is passed as keywords."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    on_meta = any(t.device.type == "meta" for t in tensors.values()) or any(
        t.device.type == "meta" for t in _tensors(sample))
    if on_meta:
        fake: dict[str, torch.Tensor] = {}
        by_id: dict[int, torch.Tensor] = {}
        for name, t in tensors.items():  # one meta twin per tensor, so ties stay tied
            if id(t) not in by_id:
                by_id[id(t)] = _to_meta(t.detach()).requires_grad_(t.requires_grad)
            fake[name] = by_id[id(t)]
        args, kwargs = map_tensors(as_call(model, sample), _to_meta)
        return (lambda: functional_call(model, fake, args, kwargs, tie_weights=False, strict=False)), {
            id(t) for t in by_id.values()}
    devices = {t.device for t in tensors.values()}
    args, kwargs = as_call(model, sample)
    if len(devices) == 1:
        args, kwargs = map_tensors((args, kwargs), lambda t: t.to(next(iter(devices))))
    return (lambda: model(*args, **kwargs)), {id(t) for t in tensors.values()}


def trace_units(
    model: nn.Module, units: list[Unit], sample: Any, *, measure_time: bool = False, repeat: int = 3
) -> tuple[list[LayerCost], list[int], Counter[int]]:
    """Costs of each unit, the order they run in (indices into ``units``; one never called after
    its registered neighbour) and how often each unit ran in one forward on the sample (a
    Counter: a unit that did not run is absent; without a sample every unit counts once)."""
    costs = [_static_cost(u) for u in units]
    if sample is None:
        return costs, list(range(len(units))), Counter(range(len(units)))
    index = {id(u.module): i for i, u in enumerate(units)}
    order: list[int] = []
    stack: list[int] = []
    saved = [0] * len(units)
    transient = [0] * len(units)
    seconds = [float("inf")] * len(units)
    started: dict[int, float] = {}
    seen: set[int] = set()
    weights: set[int] = set()
    run_seconds = [0.0] * len(units)

    calls: Counter[int] = Counter()

    def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
        i = index[id(module)]
        calls[i] += 1
        if i not in order:
            order.append(i)
        stack.append(i)
        transient[i] = max(transient[i], _nbytes((args, kwargs)))
        _sync((args, kwargs))
        started[i] = time.perf_counter()

    def post(module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        i = index[id(module)]
        _sync(out)
        elapsed = time.perf_counter() - started.pop(i, time.perf_counter())
        run_seconds[i] += elapsed
        if stack and stack[-1] == i:
            stack.pop()
        transient[i] = max(transient[i], _nbytes((args, kwargs)) + _nbytes(out))

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(t) in weights or id(base) in weights or id(base) in seen:
            return t
        seen.add(id(base))
        where = stack[-1] if stack else (order[-1] if order else 0)
        saved[where] += base.numel() * base.element_size()
        return t

    handles = [u.module.register_forward_pre_hook(pre, with_kwargs=True) for u in units]
    handles += [u.module.register_forward_hook(post, with_kwargs=True) for u in units]
    modes = {m: m.training for m in model.modules()}
    snapshot = {id(b): b.detach().clone() for b in model.buffers() if b.device.type != "meta"}
    runs = repeat + 1 if measure_time else 1
    try:
        model.train()  # size and time what training will run (dropout masks, batch statistics)
        with torch.random.fork_rng(devices=[]):
            for _ in range(runs):
                run_seconds[:] = [0.0] * len(units)
                calls.clear()
                saved[:] = [0] * len(units)  # each run counts them afresh
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    seen.clear()
                    try:
                        call, ids = _prepare_run(model, sample)
                        weights.clear()
                        weights.update(ids)
                        call()
                    except SplitError:
                        raise
                    except Exception as exc:
                        text = str(exc).splitlines()[0] if str(exc) else ""
                        if "meta tensor" in text:
                            raise SplitError(
                                f"model {type(model).__name__} cannot run on the meta device: its forward reads a "
                                f"tensor's value ({text}); plan it with real weights and a real sample, or leave out "
                                "the input it reads (an attention_mask of ones)") from exc
                        raise SplitError(
                            f"model {type(model).__name__} failed on the sample: {type(exc).__name__}: "
                            f"{text}; pass the model's first input as sample=..., or its keyword batch as a dict "
                            "(sample={'input_ids': ids, ...})"
                        ) from exc
                    stack.clear()
                seconds = [min(a, b) for a, b in zip(seconds, run_seconds, strict=True)]
    finally:
        for h in handles:
            h.remove()
        for module, mode in modes.items():
            module.training = mode
        with torch.no_grad():
            for b in model.buffers():
                if id(b) in snapshot:
                    b.copy_(snapshot[id(b)])
    called = Counter({i: calls[i] for i in order})
    for i in range(len(units)):  # a unit never called keeps its place after its registered neighbour
        if i not in order:
            order.insert(order.index(i - 1) + 1 if i else 0, i)
    out = []
    for i, c in enumerate(costs):
        out.append(LayerCost(name=c.name, parameters=c.parameters, param_bytes=c.param_bytes,
                             buffer_bytes=c.buffer_bytes, activation_bytes=saved[i],
                             transient_bytes=transient[i],
                             seconds=seconds[i] if measure_time else None))
    return out, order, called


def _sync(obj: Any) -> None:
    for t in _tensors(obj):
        if t.device.type == "cuda":
            torch.cuda.synchronize(t.device)
            return


def _static_cost(unit: Unit) -> LayerCost:
    params: dict[int, torch.Tensor] = {}
    buffers: dict[int, torch.Tensor] = {}
    for _, t in unit.tensors():
        (params if isinstance(t, nn.Parameter) else buffers)[id(t)] = t
    return LayerCost(
        name=unit.name,
        parameters=sum(p.numel() for p in params.values()),
        param_bytes=sum(p.numel() * p.element_size() for p in params.values()),
        buffer_bytes=sum(b.numel() * b.element_size() for b in buffers.values()),
    )
