"""Check that a traced model treats samples independently, and find its outputs' batch dimension.

A pipeline cuts a batch into micro-batches and joins the outputs, which gives the whole batch's
result only if no op mixes samples (GPipe's assumption; BatchNorm is handled apart).
:func:`check_per_sample` runs a sample whole and in two halves through the traced forward (eval
mode, without grad) and names the first op whose result on the halves is neither the whole
batch's cut on dimension 0 or 1 (an LSTM's ``h_n`` holds the batch on dimension 1) nor the same
value for both (a mask), such as ``x - x.mean(0)``. It also says, for each tensor of the model's
output, which dimension holds the batch (so the pipeline joins ``h_n`` on dimension 1; router
logits ``(batch * seq, experts)`` on their flattened dimension 0) or, for a scalar the forward
computes for its output (its own loss: a batch mean is no mixing of samples when nothing else
uses it), whether it is a mean or a sum, and which buffers the forward writes (a step counter): run per micro-batch they would be updated
``chunks`` times per batch. The model is left as it was (buffers, RNG, train/eval modes).

Usage::

    from devicekit.modelparallel.chain import to_chain
    from devicekit.modelparallel.per_sample import check_per_sample

    found = check_per_sample(to_chain(lstm_model), tokens)   # SplitError if an op mixes samples
    found.output_dims      # (0, 1): logits on dimension 0, h_n on dimension 1
    found.written          # ('steps',): buffers the forward writes
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from devicekit.errors import InvalidValueError, SplitError
from devicekit.modelparallel.batchnorm import DeferredBatchNorm
from devicekit.modelparallel.chain import Chain
from devicekit.modelparallel.microbatch import batch_leaves, move, padded, scatter
from devicekit.modelparallel.state_guard import StateGuard
from devicekit.placement.walk import map_tensors

__all__ = ["SampleCheck", "check_per_sample", "batch_dim", "close_enough", "doubled", "scalar_rule"]


@dataclass(frozen=True)
class SampleCheck:
    """What :func:`check_per_sample` found."""

    #: per output tensor (walk order): the dimension holding the batch, None for a value every
    #: micro-batch shares, "mean" or "sum" for a scalar (a loss); None when the sample could not
    #: be halved (then: dimension 0)
    output_dims: tuple[int | str | None, ...] | None
    #: buffers (qualified names; BatchNorm's excluded) the forward wrote
    written: tuple[str, ...]
    #: scalar outputs ("mean"s) whose micro-batches' size-weighted mean differs from the whole batch's
    uneven: tuple[str, ...] = ()


def _what(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"module {node.target!r}"
    if node.op == "call_method":
        return f"method .{node.target}() (node {node.name!r})"
    target = getattr(node.target, "__name__", str(node.target))
    return f"op {target} (node {node.name!r})"


def _device_of(module: nn.Module) -> torch.device | None:
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return None


def _tensors(value: Any) -> list[torch.Tensor]:
    return [padded(leaf) for leaf in batch_leaves(value)]


def _record(gm: fx.GraphModule, x: Any) -> dict[fx.Node, Any]:
    values: dict[fx.Node, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n.op in ("call_module", "call_function", "call_method"):
                # the stages may already be on their devices: move each op's inputs to one
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                device = _device_of(self.fetch_attr(str(n.target))) if n.op == "call_module" else None
                found = _tensors((args, kwargs))
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


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.device.type == "meta" or b.device.type == "meta":
        return True  # no values to compare (a plan on the meta device)
    b = b.to(a.device)
    if a.is_floating_point() or a.is_complex():
        return torch.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
    return torch.equal(a, b)


def _batch_dim(full: torch.Tensor, got: list[torch.Tensor], batch: int) -> int | None | bool:
    """The dimension the halves ``got`` join on to give ``full``; None: the same value for every
    half (a constant); False: neither (the op mixes samples). The dimension holds the batch, or
    the batch's samples flattened with another dimension (``(batch * seq, experts)``): the
    halves' sizes add up to the whole's and their concatenation is the whole batch's."""
    if any(t.device.type == "meta" for t in (full, *got)):  # shapes only: the dimension of the batch's size
        return next((d for d in (0, 1) if full.dim() > d and full.size(d) == batch), None)
    if all(_close(g, full) for g in got):
        return None
    for dim in (0, 1):  # the batch's size, or a multiple: (batch * seq, experts) router logits
        if full.dim() > dim and all(g.dim() == full.dim() for g in got) and (
                full.size(dim) == batch or sum(g.size(dim) for g in got) == full.size(dim) > batch):
            rest = [s for i, s in enumerate(full.shape) if i != dim]
            if all([s for i, s in enumerate(g.shape) if i != dim] == rest for g in got):
                if _close(torch.cat(got, dim=dim), full):
                    return dim
    return False


def doubled(batch: Any) -> Any:
    """``batch`` with every tensor repeated along dimension 0 (the micro-batch twice)."""
    return map_tensors(batch, lambda t: torch.cat([t, t]))


def scalar_rule(name: str, alone: torch.Tensor | None, *, twice: torch.Tensor | None, random: bool,
                 model_name: str, chunks: int) -> str:
    """How a scalar output joins over micro-batches: "mean" (a micro-batch doubled gives the same
    value), "sum" (twice it), or refused (a loss over pairs of samples)."""
    if random or alone is None or twice is None:
        return "mean"
    if close_enough(twice, alone):
        return "mean"
    if close_enough(twice, alone * 2):
        return "sum"
    raise SplitError(
        f"cannot pipeline {model_name} with chunks={chunks}: its output {name!r} is a scalar that is neither a mean "
        "nor a sum over the samples of a batch (a micro-batch repeated twice gives neither the same value nor "
        "twice it: a loss over pairs of samples, such as in-batch negatives), so no join of micro-batches gives "
        "the whole batch's; use chunks=1 or dk.split(model, devices)")


# public names for output_join, which judges a model's outputs the same way
batch_dim = _batch_dim
close_enough = _close


def check_per_sample(chain: Chain, sample: Any, chunks: int = 2) -> SampleCheck:
    """Refuse a model where an op mixes samples across the batch; see the module doc.

    Runs ``sample`` whole and in two halves, in eval mode without grad (BatchNorm, whose
    training statistics DeferredBatchNorm handles, then treats samples alone). Ops whose results
    differ between two whole runs (random draws) are not judged."""
    gm = chain.graph_module
    try:
        halves = scatter(sample, 2)
    except InvalidValueError:
        return SampleCheck(None, ())
    if len(halves) < 2 or gm.graph is None:
        return SampleCheck(None, ())
    modes = {id(m): (m, m.training) for m in gm.modules()}
    try:
        with StateGuard(gm) as guard, torch.no_grad():
            gm.train()  # what the forward writes when training (a step counter, an EMA)
            _record(gm, halves[0])
            gm.eval()
            whole, again = _record(gm, sample), _record(gm, sample)
            parts = [_record(gm, h) for h in halves]
            results = _scalar_results(gm, whole)
            twice = _record(gm, doubled(halves[0])) if results else {}
    finally:
        for m, mode in modes.values():
            m.training = mode
            if isinstance(m, DeferredBatchNorm):
                m.discard()  # the training run's statistics are no mini-batch of the user's
    written = tuple(dict.fromkeys(guard.written))
    sizes = [_tensors(h)[0].size(0) for h in halves]
    batch = sum(sizes)
    dims: list[int | str | None] = []
    uneven: list[str] = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr") or n not in whole:
            continue
        full, repeat = _tensors(whole[n]), _tensors(again[n])
        pieces = [_tensors(p[n]) for p in parts]
        random = len(full) != len(repeat) or any(not _close(f, t) for f, t in zip(full, repeat, strict=True))
        for i, f in enumerate(full):
            got = [p[i] for p in pieces if i < len(p)]
            if n.op == "output" and f.dim() == 0:  # a loss the model computes: a mean or a sum
                doubled_leaf = _tensors(twice[n])[i] if n in twice else None
                rule = scalar_rule(f"output {i}", got[0] if got else None, twice=doubled_leaf, random=random,
                                   model_name=chain.model_name, chunks=chunks)
                dims.append(rule)
                if rule == "mean" and not random and len(got) == len(pieces) and not _close(
                        sum(g * s for g, s in zip(got, sizes, strict=True)) / batch, f):
                    uneven.append(f"output {i}")
                continue
            dim = False if random or len(got) != len(pieces) else _batch_dim(f, got, batch)
            if n.op == "output":
                dims.append(0 if dim is False else dim)  # random draws: cut on dimension 0
            elif dim is False and not random and len(got) == len(pieces) and n not in results:
                raise SplitError(
                    f"cannot pipeline {chain.model_name}: {_what(n)} mixes samples across the batch (its result "
                    "on micro-batches differs from the whole batch's); a pipeline, like GPipe, needs samples to "
                    "be independent except in BatchNorm: use chunks=1 or dk.split(model, devices)")
    return SampleCheck(tuple(dims), written, tuple(uneven))


def _scalar_results(gm: fx.GraphModule, values: dict[fx.Node, Any]) -> set[fx.Node]:
    """Nodes whose value is a scalar tensor used only towards the output (a loss the forward computes),
    not by anything that goes on to use the batch."""
    found: set[fx.Node] = set()
    for n in reversed(gm.graph.nodes):
        value = values.get(n)
        if isinstance(value, torch.Tensor) and value.dim() == 0 and n.users and all(
                u.op == "output" or u in found for u in n.users):
            found.add(n)
    return found


