"""Join a model's outputs over micro-batches, and learn how from the model itself.

A model called on micro-batches returns one output per micro-batch (a tensor, a tuple, a
Hugging Face ``ModelOutput`` with ``loss`` and ``logits``). Each tensor in it is joined by a
rule learned once, on a sample, by :func:`learn_join`:

* a tensor with a batch dimension (``logits``, ``hidden_states``) is concatenated along it
  (dimension 0, or 1 for an LSTM's ``h_n``); one equal for every micro-batch is taken once;
* a scalar (``loss``) is the mean of the micro-batches' values weighted by their sizes
  (``sum(loss_i * b_i) / B``; ``torch.stack(losses).mean()`` when the sizes are equal), or
  their sum. Which one: the model runs a micro-batch ``h`` alone and doubled (``h`` twice in one
  batch). A mean over samples or tokens (every Hugging Face loss) gives the same value on both,
  a sum twice the value; anything else (a loss over pairs of samples, as a contrastive loss
  with in-batch negatives) is refused: it is not a function of the micro-batches alone.
  Hugging Face losses are means per micro-batch, so the joined loss equals the whole batch's
  when every sample counts the same number of tokens (no padding, no ignored labels), and is
  otherwise the mean of the micro-batches' means, as gradient accumulation computes it. A loss
  normalised by a count given in the call (``num_items_in_batch``) is a sum.
* a tensor whose micro-batch results are not the whole batch's cut (an op that mixes samples)
  is refused, naming the output.

Usage::

    from devicekit.modelparallel.output_join import join, learn_join

    how = learn_join(run, sample, "LlamaForCausalLM", chunks=2)   # run(batch) -> output
    out = join([out0, out1], sizes=[4, 4], how=how)               # ModelOutput, loss averaged
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from devicekit.errors import SplitError
from devicekit.modelparallel.microbatch import batch_leaves, gather, map_leaves, padded, scatter
from devicekit.modelparallel.per_sample import batch_dim, close_enough

__all__ = ["Join", "join", "learn_join", "leaf_names", "doubled"]

#: per leaf of the output (walk order): a batch dimension, None (shared), "mean" or "sum"
Join = tuple[int | str | None, ...]


def leaf_names(obj: Any, prefix: str = "output") -> list[str]:
    """A readable path for each tensor of ``obj`` in walk order: ``logits``, ``hidden_states[2]``."""
    names: list[str] = []
    if isinstance(obj, torch.Tensor) or type(obj).__name__ == "PackedSequence":
        return [prefix]
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            names += leaf_names(value, str(key) if prefix == "output" else f"{prefix}.{key}")
    elif isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            names += leaf_names(value, f"{prefix}[{i}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            names += leaf_names(getattr(obj, f.name), f"{prefix}.{f.name}")
    return names


def doubled(batch: Any) -> Any:
    """``batch`` with every tensor repeated along dimension 0 (the micro-batch twice)."""
    from devicekit.placement.walk import map_tensors

    return map_tensors(batch, lambda t: torch.cat([t, t]))


def join(outputs: list[Any], sizes: Sequence[int], how: Join | None) -> Any:
    """The micro-batch ``outputs`` as one output (see the module doc); ``how`` from :func:`learn_join`."""
    if len(outputs) == 1:
        return outputs[0]
    leaves = batch_leaves(outputs[0])
    rule = how if how is not None else tuple("mean" if isinstance(t, torch.Tensor) and t.dim() == 0 else 0
                                             for t in leaves)
    if len(rule) != len(leaves):
        raise SplitError(f"the model returned {len(leaves)} tensors where the first batch gave {len(rule)}; "
                         "a pipeline needs the same outputs on every call (use chunks=1)")
    scalars = [i for i, r in enumerate(rule) if r in ("mean", "sum")]
    dims = [None if i in scalars else r for i, r in enumerate(rule)]
    joined = gather(outputs, dims)
    if not scalars:
        return joined
    total = sum(sizes)
    columns = [batch_leaves(o) for o in outputs]
    final = batch_leaves(joined)
    for i in scalars:
        parts = torch.stack([c[i].to(columns[0][i].device) for c in columns])
        if rule[i] == "sum":
            final[i] = parts.sum()
        elif len(set(sizes)) == 1:
            final[i] = parts.mean()
        else:
            weights = torch.tensor([b / total for b in sizes], dtype=parts.dtype, device=parts.device)
            final[i] = (parts * weights).sum()
    found = iter(final)
    return map_leaves(joined, lambda t: next(found))


def learn_join(run: Callable[[Any], Any], sample: Any, model_name: str, chunks: int) -> Join | None:
    """How to join ``run``'s outputs (see the module doc), learned on ``sample``; None if it cannot be halved.

    ``run(batch)`` calls the model (eval mode, no grad: the caller's job). Refuses an output that
    mixes samples or a scalar that is neither a mean nor a sum."""
    halves = scatter(sample, 2)
    if len(halves) < 2:
        return None
    whole, again = run(sample), run(sample)
    parts = [run(h) for h in halves]
    twice = run(doubled(halves[0]))
    names = leaf_names(whole)
    full, repeat = [padded(t) for t in batch_leaves(whole)], [padded(t) for t in batch_leaves(again)]
    pieces = [[padded(t) for t in batch_leaves(p)] for p in parts]
    twin = [padded(t) for t in batch_leaves(twice)]
    batch = sum(padded(batch_leaves(h)[0]).size(0) for h in halves)
    how: list[int | str | None] = []
    for i, f in enumerate(full):
        name = names[i] if i < len(names) else f"output {i}"
        random = i >= len(repeat) or not close_enough(f, repeat[i])
        got = [p[i] for p in pieces if i < len(p)]
        if f.dim() == 0:
            how.append(_scalar_rule(name, got[0] if got else None, twin[i] if i < len(twin) else None, random,
                                    model_name, chunks))
            continue
        dim = False if random or len(got) != len(pieces) else batch_dim(f, got, batch)
        if dim is False and not random:
            raise SplitError(
                f"cannot pipeline {model_name} with chunks={chunks}: its output {name!r} on micro-batches differs "
                "from the whole batch's (an op mixes samples across the batch); a pipeline, like GPipe, needs "
                "samples to be independent except in BatchNorm: use chunks=1 or dk.split(model, devices)")
        how.append(0 if dim is False else dim)
    return tuple(how)


def _scalar_rule(name: str, alone: torch.Tensor | None, twice: torch.Tensor | None, random: bool,
                 model_name: str, chunks: int) -> str:
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
