"""Plan a pipeline at block boundaries, for models whose forward is not traced (Hugging Face's).

A transformers model is a chain of blocks in an ``nn.ModuleList`` (``model.layers``,
``transformer.h``, ``encoder.layer``, an encoder's and a decoder's ``layers``, a convnet's
``encoder.stages``) with glue before and after (embeddings, masks, a final norm, the head, the
loss). :func:`block_lists` finds those lists: ``nn.ModuleList`` s of same-class modules with
parameters, not inside another such list (a MoE layer's experts are not blocks). The pipeline is
cut at their boundaries: stage ``k`` begins when a micro-batch enters its first block; the glue
before the first block runs in stage 0, the glue after the last block in the last stage, glue
between blocks in the stage of the block before it. ``stages=["model.layers.8", ...]`` (module
paths as ``torch.distributed.pipelining`` names its split points) names the modules that begin
stages instead: any modules the forward calls once each, in order. With fewer blocks than
devices (or none, or blocks that share weights: ALBERT runs one layer group ``N`` times) the cut
falls between the model's units in the order they run instead (its embeddings, its encoder, ...).

The units placed on devices are those :mod:`~devicekit.modelparallel.unit_plan` measures, with
the ancestors of the blocks opened so every block is a unit; tied units (an embedding and the
head) join the device of the first one to run, wherever the stages are. Balance: ``"size"``
(weights, gradients, optimizer state, saved activations with a sample), ``"time"`` or a list of
block counts per device (each count includes the glue that runs in that stage).

Usage::

    from devicekit.modelparallel.blocks import block_lists, plan_blocks

    block_lists(llama)                     # ['model.layers']
    staged = plan_blocks(llama, [cpu, cpu], sample={"input_ids": ids})
    staged.cuts                            # ('model.layers.2',): stage 1 begins there
    print(staged.plan)                     # units per device, tied embeddings, reasons
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from devicekit.errors import InvalidValueError, SplitError
from devicekit.modelparallel.balance import balance_cost
from devicekit.modelparallel.chain import check_stage_names
from devicekit.modelparallel.layer_profile import optimizer_factor
from devicekit.modelparallel.module_units import group_count
from devicekit.modelparallel.partition import Plan, check_counts, plan_from_counts
from devicekit.modelparallel.unit_plan import Measured, finish_plan, unit_costs

__all__ = ["BlockPlan", "block_lists", "plan_blocks", "suggest_stages"]


@dataclass(frozen=True)
class BlockPlan:
    """Where a model's pipeline stages begin, and the placement of its units."""

    plan: Plan
    #: the modules that begin stages 1, 2, ... (stage 0 begins with the forward)
    cuts: tuple[str, ...]
    #: the blocks of the model's block lists (recomputed one by one when checkpointing)
    blocks: tuple[str, ...]


def block_lists(model: nn.Module) -> list[str]:
    """Names of ``model``'s block lists, in registration order (see the module doc)."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(name.startswith(f"{outer}.") for outer in found):
            continue  # inside a block of a list found already (a MoE layer's experts)
        kinds = {type(child) for child in module}
        if len(kinds) != 1 or any(isinstance(child, (nn.ModuleList, nn.ModuleDict)) for child in module):
            continue
        if not any(True for child in module for _ in child.parameters()):
            continue
        found.append(name)
    return found


def _ancestors(names: Sequence[str]) -> frozenset[str]:
    return frozenset(n.rsplit(".", i)[0] for n in names for i in range(1, n.count(".") + 1))


def plan_blocks(
    model: nn.Module, devices: list[torch.device], *, balance: str | Sequence[int] = "size", sample: Any = None,
    optimizer: str | float | None = "adam", stages: Sequence[str] | None = None,
) -> BlockPlan:
    """Cut ``model`` at its block boundaries (or before ``stages``) into ``len(devices)`` stages."""
    name = type(model).__name__
    factor = optimizer_factor(optimizer)
    lists = block_lists(model)
    blocks = [f"{lst}.{i}" for lst in lists for i in range(len(model.get_submodule(lst)))]
    named = None if stages is None else check_stage_names(model, stages)
    if isinstance(balance, str) and balance not in ("size", "time"):
        raise InvalidValueError(f"balance {balance!r} is unknown; use 'size', 'time' or a list of block counts")
    timed = balance == "time"
    if timed and sample is None:
        raise SplitError("balance='time' needs a sample to time; pass sample=... or use balance='size'")
    marks = named if named is not None else blocks
    measured = unit_costs(model, sample, measure_time=timed, opened=_ancestors(marks))
    index = {unit: i for i, (unit, _) in enumerate(measured.sequence)}
    followers = {f: anchor for anchor, fs in measured.followers.items() for f in fs}

    def once(unit: str) -> bool:  # a stage can begin only where the forward passes once
        return measured.calls.get(unit, 1) == 1

    for mark in marks:
        if named is not None and mark in index and not once(mark):
            advice = _advice(model, devices, sample, optimizer)
            raise InvalidValueError(f"stages: {mark!r} cannot begin a stage: it runs {measured.calls[mark]} times "
                                    f"in one forward; name a module called once{advice}")
        if mark not in index and named is not None:
            why = (f"it is tied to {followers[mark]!r} ({measured.tie_of(followers[mark])}), so it runs where "
                   "that one lives"
                   if mark in followers else "its parent's forward uses its weights directly")
            raise InvalidValueError(f"stages: {mark!r} cannot begin a stage: {why}; name another module"
                                    f"{_advice(model, devices, sample, optimizer)}")
    starts = sorted({index[m] for m in marks if m in index and once(m)})
    what = "stage" if named is not None else "block"
    where = f"blocks of {', '.join(lists)}" if named is None else "the named modules"
    if named is None and len(starts) < len(devices):
        # fewer blocks than devices, none, or blocks that share weights (ALBERT runs one layer group N
        # times): cut between the units in the order they run instead
        measured, starts = _finest_units(model, sample, timed, len(devices))
        what, where = "unit", "its units"
    if named is None:
        starts[0] = 0  # glue before the first block joins its stage
    elif starts[0] != 0 and len(starts) < len(devices):
        starts.insert(0, 0)  # split points (n - 1 names): the glue before the first is a stage
    else:
        starts[0] = 0
    bounds = [*starts, len(measured.sequence)]
    weights = [sum((c.seconds or 0.0) if timed else c.memory(training=True, optimizer=factor)
                   for c in measured.costs[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    segments = len(weights)
    if named is not None and segments != len(devices):
        hint = _advice(model, devices, sample, optimizer)
        want = "1 module where stage 1 begins" if len(devices) == 2 else \
            f"{len(devices) - 1} modules where stages 1..{len(devices) - 1} begin"
        raise InvalidValueError(f"stages: {len(named)} name(s) give {segments} stage(s) for {len(devices)} "
                                f"device(s); name {want}{hint}")
    if isinstance(balance, str):
        if len(devices) > segments:
            raise SplitError(
                f"cannot cut {name} into {len(devices)} stages: it has {segments} {what}(s) to cut between; "
                f"pass at most {segments} devices")
        counts = [1] * segments if named is not None else balance_cost(weights, len(devices))
    else:
        counts = check_counts(balance, segments, len(devices), what=what)
    unit_counts, seg = [], 0
    for count in counts:
        unit_counts.append(bounds[seg + count] - bounds[seg])
        seg += count
    firsts = [sum(unit_counts[:k]) for k in range(1, len(devices))]
    cuts = tuple(measured.sequence[i][0] for i in firsts)
    begins = (f"stage 1 begins at {cuts[0]!r}" if len(cuts) == 1
              else f"stages 1..{len(cuts)} begin at {', '.join(repr(c) for c in cuts)}")
    reasons = [f"pipelined at module boundaries ({where}): the model's own forward runs unchanged; {begins}; "
               "what runs before (embeddings, masks) is stage 0's, what runs after the last cut (norm, head, "
               "loss) the last stage's",
               f"{segments} {what}(s) cut into {len(devices)} parts: {counts}"]
    if sample is None:
        reasons.append("no sample given: activations are not counted and units are in the order they are "
                       "registered; pass sample=<a batch> to measure them")
    plan = plan_from_counts(measured.sequence, measured.costs, devices, unit_counts,
                            basis=balance if isinstance(balance, str) else "given", optimizer=factor, reasons=reasons)
    plan = finish_plan(plan, measured.followers, measured.ties, measured.units, measured.repeats)
    placed = {n for p in plan.parts for n in p.layer_names}
    return BlockPlan(plan, cuts, tuple(b for b in blocks if b in placed))


def _finest_units(model: nn.Module, sample: Any, timed: bool, devices: int) -> tuple[Measured, list[int]]:
    """The model's units, opened until ``devices`` of them can begin a stage (called once per
    forward), or as far as they open: the most stage starts any opening gives. So every count of
    devices up to that most works (monotone, like ``dk.split``), and a refusal's "at most" too."""
    at_least, best = devices, None
    while True:
        measured = unit_costs(model, sample, measure_time=timed, at_least=at_least)
        starts = [0, *(i for i, (unit, _) in enumerate(measured.sequence)
                       if i and measured.calls.get(unit, 1) == 1)]
        if best is None or len(starts) > len(best[1]):
            best = (measured, starts)
        groups = group_count(measured.units)
        if len(starts) >= devices or groups < at_least:  # enough, or nothing left to open
            return best
        at_least = groups + 1  # the next opening (find_units opens one module at a time, in a fixed order)


def _hint(measured: Measured, candidates: list[int], devices: int, factor: float) -> str:
    """Names that would work: the balanced cut at the candidates (the blocks, else the named modules)."""
    starts = sorted({0, *candidates})
    if len(starts) < devices:
        return ""
    bounds = [*starts, len(measured.sequence)]
    weights = [sum(c.memory(training=True, optimizer=factor) for c in measured.costs[a:b])
               for a, b in zip(bounds, bounds[1:], strict=False)]
    counts = balance_cost(weights, devices)
    return ", e.g. stages=" + repr([measured.sequence[starts[sum(counts[:k])]][0] for k in range(1, devices)])


def _advice(model: nn.Module, devices: list[torch.device], sample: Any, optimizer: str | float | None) -> str:
    """``, e.g. stages=[...]``: the cut a pipeline makes by itself (at its blocks, or its units)."""
    try:
        return f", e.g. stages={list(plan_blocks(model, devices, sample=sample, optimizer=optimizer).cuts)!r}"
    except (SplitError, InvalidValueError):
        pass
    try:
        measured = unit_costs(model, sample, at_least=len(devices))
    except SplitError:
        return ""
    return _hint(measured, _called_once(measured), len(devices), optimizer_factor(optimizer))


def _called_once(measured: Measured) -> list[int]:
    """Positions in ``measured.sequence`` of the units the forward runs once (where a stage can begin)."""
    return [i for i, (unit, _) in enumerate(measured.sequence) if measured.calls.get(unit, 1) == 1]


def suggest_stages(model: nn.Module, devices: Sequence[Any], sample: Any) -> str:
    """Advice that works when followed: ``stages=[...]`` naming units that begin balanced stages
    (in the order they run on ``sample``, else as registered), or ``dk.split``."""
    n = len(devices)
    try:
        measured = unit_costs(model, sample, at_least=n)
    except SplitError:
        measured = None
    names = "" if measured is None else _hint(measured, _called_once(measured), n, 2.0).removeprefix(", e.g. ")
    if not names:
        return ("pass stages=[...] naming the modules that begin each stage (modules its forward calls once each, "
                "in order), or use dk.split(model, devices), which runs any forward")
    where = "the module where stage 1 begins" if n == 2 else f"the modules where stages 1..{n - 1} begin"
    return (f"pass {names} ({where}; its forward then runs as it is, placed by hooks), "
            "or use dk.split(model, devices), which runs any forward")
