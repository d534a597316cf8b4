"""Turn any ``nn.Module`` into an equivalent chain of stages (an ``nn.Sequential``) to pipeline it.

A pipeline needs a chain: stage ``j + 1`` takes what stage ``j`` returns. A model's forward is
traced (:mod:`~devicekit.modelparallel.trace`: ``torch.fx``, grad-mode blocks and buffer writes
kept) into a graph whose calls of submodules are kept whole (its units, as
:mod:`~devicekit.modelparallel.module_units` finds them: ``blocks.0``, a ResNet block, ``lm_head``;
or the modules named in ``stages``), and the graph is cut before each such call. Every stage
takes the values live across its first cut (a skip connection's input, a mask, an int from
``x.size(1)``) and returns those live across its last one, so values needed later pass through
the stages in between; the last stage returns the model's output. Stages are
``torch.fx.GraphModule`` objects that hold the model's own submodules and parameters (nothing is
copied: gradients land in the model), so tied parameters used by two stages are seen by
:mod:`~devicekit.modelparallel.sharing` like those of any ``nn.Sequential``.

* ``stages=None``: cut before every unit; the pipeline's balance then groups consecutive stages
  per device. ``stages=["wte", "blocks.2", "lm_head"]``: cut only where those submodules are
  called (control flow *inside* a named module, or any module not containing one, is fine).
* A forward that does not trace (data-dependent control flow in the model's own forward) is
  refused with the tracer's reason, offering ``stages=[...]`` or ``dk.split``.
* A cut inside a ``no_grad`` block: the stage after it switches grad off first, the stage before
  it puts the caller's grad mode back at its end.
* Micro-batches must be independent: :mod:`~devicekit.modelparallel.per_sample` checks it.

Usage::

    from devicekit.modelparallel.chain import to_chain

    chain = to_chain(gpt)                          # nn.Sequential: wte, blocks_0, ..., lm_head
    chain = to_chain(gpt, stages=["wte", "blocks.2"])   # two stages
    chain(tokens)                                  # == gpt(tokens)
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from torch import fx, nn

from devicekit.errors import InvalidValueError, SplitError
from devicekit.modelparallel.module_units import find_units
from devicekit.modelparallel.trace import (
    UntraceableError,
    grad_mode_enter,
    grad_mode_restore,
    grad_regions,
    trace_module,
)

__all__ = ["Chain", "to_chain", "check_stage_names"]


class Chain(nn.Sequential):
    """The stages of a traced model, in order; ``graph`` is the whole traced forward."""

    def __init__(self, stages: OrderedDict[str, nn.Module], graph: fx.GraphModule, model_name: str) -> None:
        super().__init__(stages)
        object.__setattr__(self, "graph_module", graph)  # not a submodule: the stages hold the layers
        object.__setattr__(self, "model_name", model_name)


def check_stage_names(model: nn.Module, stages: Any) -> list[str]:
    if isinstance(stages, str) or not isinstance(stages, Sequence) or not all(isinstance(s, str) for s in stages):
        raise InvalidValueError(f"stages {stages!r} must be a list of submodule names, e.g. ['embed', 'blocks.2']")
    names = list(dict.fromkeys(stages))
    if not names:
        raise InvalidValueError("stages [] names no submodule; name at least one, e.g. ['blocks.2'], or leave it out")
    known = dict(model.named_modules())
    for n in names:
        if n == "" or n not in known:
            some = ", ".join(repr(k) for k in list(known)[1:5])
            raise InvalidValueError(f"stages: {type(model).__name__} has no submodule {n!r}; names look like {some}")
    for a in names:
        for b in names:
            if b.startswith(a + "."):
                raise InvalidValueError(f"stages: {a!r} contains {b!r}; name modules that do not contain one another")
    return names


def to_chain(model: nn.Module, stages: Sequence[str] | None = None) -> Chain:
    """``model`` as a :class:`Chain` of stages cut before its units (or before ``stages``)."""
    name = type(model).__name__
    if type(model).forward is nn.Module.forward:
        raise SplitError(f"cannot pipeline {name}: it has no forward to trace; pipeline a module that defines one")
    if stages is None:
        units, _ = find_units(model)
        cut_at = {u.name for u in units}
        gm = trace_module(model, cut_at, set())
    else:
        cut_at = set(check_stage_names(model, stages))
        opened = {n.rsplit(".", i)[0] for n in cut_at for i in range(1, n.count(".") + 1)}
        gm = trace_module(model, None, opened | {""})
    nodes = list(gm.graph.nodes)
    body = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output")]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = next(n for n in nodes if n.op == "output")
    starts: list[int] = []
    seen: set[str] = set()
    for i, n in enumerate(body):
        if n.op == "call_module" and n.target in cut_at and (stages is None or n.target not in seen):
            seen.add(str(n.target))
            starts.append(i)
    if stages is not None:
        missing = [s for s in stages if s not in seen]
        if missing:
            raise InvalidValueError(f"stages: submodule {missing[0]!r} is not called by {name}'s own forward "
                                    "(nor by a module that contains another name); name modules the forward calls")
    if not starts:
        starts = [0]
    elif not any(n.op == "call_module" for n in body[:starts[0]]):
        starts[0] = 0  # ops before the first module call (``t = idx.size(1)``) join its stage
    elif starts[0] != 0:
        starts.insert(0, 0)
    if len(placeholders) != 1:
        raise UntraceableError(f"cannot pipeline {name}: its forward takes {len(placeholders)} inputs; pass one batch")
    bounds = [*starts, len(body)]
    position = {n: i for i, n in enumerate(body)}
    last_use: dict[fx.Node, int] = {}
    for n in body + [out_node]:
        for used in n.all_input_nodes:
            last_use[used] = max(last_use.get(used, -1), position.get(n, len(body)))
    made: OrderedDict[str, nn.Module] = OrderedDict()
    inputs: list[fx.Node] = placeholders
    regions = grad_regions(body)  # no_grad blocks open at each cut
    for k in range(len(starts)):
        a, b = bounds[k], bounds[k + 1]
        outputs = [v for v in (*placeholders, *body[:b]) if v in last_use and last_use[v] >= b] if k < len(starts) - 1 else []
        stage = _stage(gm, body[a:b], inputs, outputs, out_node if k == len(starts) - 1 else None, first=k == 0,
                       grad_at=(regions[a], regions[b]))
        called = [n.target for n in body[a:b] if n.op == "call_module"]
        key = str(called[0] if called else "input").replace(".", "_")
        while key in made:
            key += "_"
        made[key] = stage
        inputs = outputs
    return Chain(made, gm, name)


def _stage(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
           out_node: fx.Node | None, *, first: bool, grad_at: tuple[list[bool], list[bool]]) -> fx.GraphModule:
    """One stage's graph. ``grad_at``: grad modes of the blocks open at its start and at its end;
    a stage that starts inside ``no_grad`` switches grad off first, and one that ends inside it
    puts the caller's mode back (its thread runs the next stage, or the caller goes on)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if first:
        env[inputs[0]] = graph.placeholder(inputs[0].name)
    else:
        live = graph.placeholder("live")
        for i, v in enumerate(inputs):
            env[v] = graph.call_function(operator.getitem, (live, i))
    open_start, open_end = grad_at
    entry = None
    if open_start or open_end:
        entry = graph.call_function(grad_mode_enter, (open_start[-1] if open_start else None,))

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env and n.op == "get_attr":  # parameters and constants: read where used
            env[n] = graph.get_attr(str(n.target))
        return env[n]

    for n in nodes:
        env[n] = graph.node_copy(n, lookup)
    if open_end:
        graph.call_function(grad_mode_restore, (entry,))
    if out_node is not None:
        graph.output(fx.map_arg(out_node.args[0], lookup))
    else:
        graph.output(tuple(env[v] for v in outputs))
    return fx.GraphModule(gm, graph, class_name="Stage")
