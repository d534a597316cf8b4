"""Turn any ``nn.Module`` into an equivalent chain of stages (an ``nn.Sequential``) to pipeline it.

A pipeline needs a chain: stage ``j + 1`` takes what stage ``j`` returns. A model's forward is
traced with ``torch.fx`` into a graph whose calls of submodules are kept whole (its units, as
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
* Micro-batches must be independent: :func:`check_per_sample` runs a sample whole and in two
  halves (eval mode, so BatchNorm uses running statistics) and names the first op whose result
  on the halves is not the whole batch's, such as ``x - x.mean(0)``.

Usage::

    from devicekit.modelparallel.chain import to_chain, check_per_sample

    chain = to_chain(gpt)                          # nn.Sequential: wte, blocks_0, ..., lm_head
    chain = to_chain(gpt, stages=["wte", "blocks.2"])   # two stages
    check_per_sample(chain, tokens)                # refuses ops that mix samples
    chain(tokens)                                  # == gpt(tokens)
"""

from __future__ import annotations

import inspect
import operator
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from devicekit.errors import InvalidValueError, SplitError
from devicekit.modelparallel.microbatch import move, scatter
from devicekit.modelparallel.module_units import find_units
from devicekit.placement.walk import map_tensors

__all__ = ["Chain", "to_chain", "check_per_sample"]


class Chain(nn.Sequential):
    """The stages of a traced model, in order; ``graph`` is the whole traced forward."""

    def __init__(self, stages: OrderedDict[str, nn.Module], graph: fx.GraphModule, model_name: str) -> None:
        super().__init__(stages)
        object.__setattr__(self, "graph_module", graph)  # not a submodule: the stages hold the layers
        object.__setattr__(self, "model_name", model_name)


class _Tracer(fx.Tracer):
    def __init__(self, leaves: set[str] | None, opened: set[str]) -> None:
        super().__init__()
        self.leaves, self.opened = leaves, opened

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.opened:
            return False
        if self.leaves is None or module_qualified_name in self.leaves:
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 140 else text[:137] + "..."


def _concrete_args(model: nn.Module) -> dict[str, Any]:
    """Defaults of the forward's parameters after the first: a pipeline feeds one batch."""
    params = list(inspect.signature(model.forward).parameters.values())
    name = type(model).__name__
    if not params:
        raise SplitError(f"cannot pipeline {name}: its forward takes no input; a pipeline feeds it one batch")
    concrete: dict[str, Any] = {}
    for p in params[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is inspect.Parameter.empty:
            raise SplitError(
                f"cannot pipeline {name}: its forward needs argument {p.name!r} besides the batch; a pipeline "
                "feeds one batch: take a tuple or dict as the first argument, or use dk.split(model, devices)")
        concrete[p.name] = p.default
    return concrete


def _trace(model: nn.Module, leaves: set[str] | None, opened: set[str]) -> fx.GraphModule:
    try:
        graph = _Tracer(leaves, opened).trace(model, concrete_args=_concrete_args(model) or None)
    except (SplitError, InvalidValueError):
        raise
    except Exception as e:  # the tracer's reason, whatever raised it
        raise SplitError(
            f"cannot pipeline {type(model).__name__}: its forward does not trace into a chain of stages "
            f"(torch.fx: {_short(e)}); pass stages=[...] naming submodules to cut before (control flow "
            "inside them is fine), or use dk.split(model, devices), which runs any forward") from None
    return fx.GraphModule(model, graph, class_name=type(model).__name__)


def _check_names(model: nn.Module, stages: Any) -> list[str]:
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
        gm = _trace(model, cut_at, set())
    else:
        cut_at = set(_check_names(model, stages))
        opened = {n.rsplit(".", i)[0] for n in cut_at for i in range(1, n.count(".") + 1)}
        gm = _trace(model, None, opened | {""})
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
        raise SplitError(f"cannot pipeline {name}: its forward takes {len(placeholders)} inputs; pass one batch")
    bounds = [*starts, len(body)]
    position = {n: i for i, n in enumerate(body)}
    last_use: dict[fx.Node, int] = {}
    for n in body + [out_node]:
        for used in n.all_input_nodes:
            last_use[used] = max(last_use.get(used, -1), position.get(n, len(body)))
    made: OrderedDict[str, nn.Module] = OrderedDict()
    inputs: list[fx.Node] = placeholders
    for k in range(len(starts)):
        a, b = bounds[k], bounds[k + 1]
        outputs = [v for v in (*placeholders, *body[:b]) if v in last_use and last_use[v] >= b] if k < len(starts) - 1 else []
        stage = _stage(gm, body[a:b], inputs, outputs, out_node if k == len(starts) - 1 else None, first=k == 0)
        called = [n.target for n in body[a:b] if n.op == "call_module"]
        key = str(called[0] if called else "input").replace(".", "_")
        while key in made:
            key += "_"
        made[key] = stage
        inputs = outputs
    return Chain(made, gm, name)


def _stage(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node],
           out_node: fx.Node | None, *, first: bool) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if first:
        env[inputs[0]] = graph.placeholder(inputs[0].name)
    else:
        live = graph.placeholder("live")
        for i, v in enumerate(inputs):
            env[v] = graph.call_function(operator.getitem, (live, i))

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env and n.op == "get_attr":  # parameters and constants: read where used
            env[n] = graph.get_attr(str(n.target))
        return env[n]

    for n in nodes:
        env[n] = graph.node_copy(n, lookup)
    if out_node is not None:
        graph.output(fx.map_arg(out_node.args[0], lookup))
    else:
        graph.output(tuple(env[v] for v in outputs))
    return fx.GraphModule(gm, graph, class_name="Stage")


def _what(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"module {node.target!r}"
    if node.op == "call_method":
        return f"method .{node.target}() (node {node.name!r})"
    target = getattr(node.target, "__name__", str(node.target))
    return f"op {target} (node {node.name!r})"


def _record(gm: fx.GraphModule, x: Any) -> dict[fx.Node, Any]:
    values: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n.op in ("call_module", "call_function", "call_method"):
                # the stages may already be on their devices: move each op's inputs to one
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                device = _device_of(self.fetch_attr(str(n.target))) if n.op == "call_module" else None
                found = _leaves((args, kwargs))
                device = device or (found[0].device if found else None)
                if device is not None:
                    args, kwargs = move((args, kwargs), device)
                out = getattr(self, n.op)(n.target, args, kwargs)
            else:
                out = super().run_node(n)
            values[n] = out
            return out

    Recorder(gm).run(x)
    return values


def _device_of(module: nn.Module) -> torch.device | None:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return None


def _leaves(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(value, lambda t: found.append(t) or t)
    return found


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device.type == "meta" or b.device.type == "meta":
        return True  # no values to compare (a plan on the meta device)
    b = b.to(a.device)
    if a.is_floating_point() or a.is_complex():
        return torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
    return torch.equal(a, b)


def check_per_sample(chain: Chain, sample: Any) -> None:
    """Refuse a model where an op mixes samples across dimension 0 (a sum over the batch, ...).

    Runs ``sample`` whole and in two halves, in eval mode without grad (BatchNorm, whose
    training statistics DeferredBatchNorm handles, then treats samples alone), and names the
    first op whose outputs on the halves are neither the whole batch's halves nor the same value
    (a mask). Ops whose results differ between two whole runs (random draws) are not judged."""
    gm = chain.graph_module
    try:
        halves = scatter(sample, 2)
    except InvalidValueError:
        return
    if len(halves) < 2 or gm.graph is None:
        return
    modes = {id(m): (m, m.training) for m in gm.modules()}
    try:
        gm.eval()
        with torch.no_grad():
            whole, again = _record(gm, sample), _record(gm, sample)
            parts = [_record(gm, h) for h in halves]
    finally:
        for m, mode in modes.values():
            m.training = mode
    batch = _leaves(halves[0])[0].size(0) + _leaves(halves[1])[0].size(0)
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr") or n not in whole:
            continue
        full, twice = _leaves(whole[n]), _leaves(again[n])
        pieces = [_leaves(p[n]) for p in parts]
        if len(full) != len(twice) or any(not _close(f, t) for f, t in zip(full, twice, strict=True)):
            continue  # random draws: nothing to compare
        for i, f in enumerate(full):
            got = [p[i] for p in pieces if i < len(p)]
            if len(got) != len(pieces):
                break
            if all(_close(g, f) for g in got):
                continue  # the same for every micro-batch: a constant such as a mask
            if f.dim() >= 1 and f.size(0) == batch and all(g.dim() == f.dim() for g in got):
                joined = torch.cat(got) if all(g.shape[1:] == f.shape[1:] for g in got) else None
                if joined is not None and _close(joined, f):
                    continue
            raise SplitError(
                f"cannot pipeline {chain.model_name}: {_what(n)} mixes samples across the batch (its result "
                "on micro-batches differs from the whole batch's); a pipeline, like GPipe, needs samples to "
                "be independent except in BatchNorm: use chunks=1 or dk.split(model, devices)")
