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
  Hugging Face losses are means over label tokens (``labels != -100``), so a size-weighted
  mean would be the whole batch's only when every sample counts the same number of tokens. When
  the batch has ``labels``, the sample is run once more with a few labels ignored in its first
  half: if weighting each micro-batch's loss by its label tokens (``"tokens"``; ``"shifted"``
  for a causal LM, which predicts tokens ``1..n``) gives the whole batch's loss there, every
  call joins so, and the loss and its gradient are the whole batch's. A mean that no weighting
  joins to the whole batch's (a load-balancing ``aux_loss``, a loss that averages per sample
  before the batch) is the micro-batches' size-weighted mean, and a warning says so once. A
  loss normalised by a count given in the call (``num_items_in_batch``) is a sum.
* a tensor whose micro-batch results are not the whole batch's cut (an op that mixes samples)
  is refused, naming the output.

Usage::

    from devicekit.modelparallel.output_join import join, learn_join

    how, uneven = learn_join(run, sample, "LlamaForCausalLM", chunks=2)   # run(batch) -> output
    out = join([out0, out1], sizes=[4, 4], how=how,                       # ModelOutput, loss joined
               counts={"shifted": [30, 28], "tokens": [32, 32]})           # label tokens per micro-batch
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from devicekit.errors import SplitError
from devicekit.modelparallel.microbatch import batch_leaves, gather, map_leaves, padded, scatter
from devicekit.modelparallel.per_sample import batch_dim, close_enough, doubled, scalar_rule
from devicekit.modelparallel.recompute import PipelineDiffers

__all__ = ["PipelineDiffers", "warn_uneven", "Join", "join", "learn_join", "leaf_names", "label_counts", "WEIGHTED"]

#: per leaf of the output (walk order): a batch dimension, None (shared), "mean" (weighted by
#: micro-batch sizes), "tokens" / "shifted" (weighted by label tokens) or "sum"
Join = tuple[int | str | None, ...]
WEIGHTED = ("mean", "tokens", "shifted")


def label_counts(batch: Any) -> dict[str, int] | None:
    """The label tokens of ``batch`` (``labels`` in a dict, or in the keywords of ``(args, kwargs)``)
    as a loss counts them: ``tokens`` (``labels != -100``) and ``shifted`` (a causal LM's
    ``labels[..., 1:]``); None without integer labels."""
    labels = _labels(batch)
    if labels is None:
        return None
    kept = labels != -100
    return {"tokens": int(kept.sum()), "shifted": int(kept[..., 1:].sum()) if labels.dim() > 1 else int(kept.sum())}


def _labels(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[1], Mapping):
        batch = batch[1]
    found = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(found, torch.Tensor) and found.dim() >= 1 and not found.is_floating_point() and found.numel():
        return found
    return None


def _with_ignored_labels(batch: Any, rows: int) -> Any:
    """``batch`` with the labels of its first row ignored past position 0 (all of it, for 1-d labels)."""
    labels = _labels(batch)
    assert labels is not None
    probe = labels.clone()
    if probe.dim() > 1:
        probe[0, 1:] = -100
    else:
        probe[0] = -100
    if isinstance(batch, tuple):
        return (batch[0], {**batch[1], "labels": probe})
    return {**batch, "labels": probe}


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


def join(outputs: list[Any], sizes: Sequence[int], how: Join | None,
         counts: Mapping[str, Sequence[int]] | None = None) -> Any:
    """The micro-batch ``outputs`` as one output (see the module doc); ``how`` from :func:`learn_join`,
    ``counts`` the micro-batches' label tokens (:func:`label_counts`) for the token-weighted rules."""
    if len(outputs) == 1:
        return outputs[0]
    leaves = batch_leaves(outputs[0])
    rule = how if how is not None else tuple("mean" if isinstance(t, torch.Tensor) and t.dim() == 0 else 0
                                             for t in leaves)
    if len(rule) != len(leaves):
        raise SplitError(f"the model returned {len(leaves)} tensors where the first batch gave {len(rule)}; "
                         "a pipeline needs the same outputs on every call (use chunks=1)")
    scalars = [i for i, r in enumerate(rule) if r in ("sum", *WEIGHTED)]
    dims = [None if i in scalars else r for i, r in enumerate(rule)]
    joined = gather(outputs, dims)
    if not scalars:
        return joined
    columns = [batch_leaves(o) for o in outputs]
    final = batch_leaves(joined)
    for i in scalars:
        parts = torch.stack([c[i].to(columns[0][i].device) for c in columns])
        weights = sizes if rule[i] == "mean" or not counts or rule[i] not in counts else counts[rule[i]]
        final[i] = parts.sum() if rule[i] == "sum" else _weighted(parts, weights)
    found = iter(final)
    return map_leaves(joined, lambda t: next(found))


def _weighted(parts: torch.Tensor, weights: Sequence[int]) -> torch.Tensor:
    """``sum(part_i * w_i) / sum(w)``; a micro-batch of weight 0 (no label token: a NaN loss) counts 0."""
    if len(set(weights)) == 1:
        return parts.mean()
    w = torch.tensor([float(x) for x in weights], dtype=parts.dtype, device=parts.device)
    if not float(w.sum()):
        return parts.mean()
    return torch.where(w > 0, parts * w, torch.zeros_like(parts)).sum() / w.sum()


def learn_join(run: Callable[[Any], Any], sample: Any, model_name: str, chunks: int) -> tuple[Join | None, list[str]]:
    """How to join ``run``'s outputs (see the module doc), learned on ``sample`` (None if it cannot be
    halved), and the names of the means no weighting joins to the whole batch's.

    ``run(batch)`` calls the model (eval mode, no grad: the caller's job). Refuses an output that
    mixes samples or a scalar that is neither a mean nor a sum."""
    halves = scatter(sample, 2)
    if len(halves) < 2:
        return None, []
    whole, again = run(sample), run(sample)
    parts = [run(h) for h in halves]
    twice = run(doubled(halves[0]))
    names = leaf_names(whole)
    full, repeat = [padded(t) for t in batch_leaves(whole)], [padded(t) for t in batch_leaves(again)]
    pieces = [[padded(t) for t in batch_leaves(p)] for p in parts]
    twin = [padded(t) for t in batch_leaves(twice)]
    sizes = [padded(batch_leaves(h)[0]).size(0) for h in halves]
    batch = sum(sizes)
    how: list[int | str | None] = []
    means: list[int] = []
    for i, f in enumerate(full):
        name = names[i] if i < len(names) else f"output {i}"
        random = i >= len(repeat) or not close_enough(f, repeat[i])
        got = [p[i] for p in pieces if i < len(p)]
        if f.dim() == 0:
            how.append(scalar_rule(name, got[0] if got else None, twice=twin[i] if i < len(twin) else None,
                                    random=random, model_name=model_name, chunks=chunks))
            if how[-1] == "mean" and not random and len(got) == len(pieces):
                means.append(i)
            continue
        dim = False if random or len(got) != len(pieces) else batch_dim(f, got, batch)
        if dim is False and not random:
            raise SplitError(
                f"cannot pipeline {model_name} with chunks={chunks}: its output {name!r} on micro-batches differs "
                "from the whole batch's (an op mixes samples across the batch); a pipeline, like GPipe, needs "
                "samples to be independent except in BatchNorm: use chunks=1 or dk.split(model, devices)")
        how.append(0 if dim is False else dim)
    uneven = _weigh_means(run, sample, halves, how, means) if means else []
    return tuple(how), [names[i] if i < len(names) else f"output {i}" for i in uneven]


def _weigh_means(run: Callable[[Any], Any], sample: Any, halves: list[Any], how: list[int | str | None],
                 means: list[int]) -> list[int]:
    """Per mean in ``means``, the weighting that joins the halves to the whole batch (``how``
    updated in place): label tokens where the batch has labels (tried with a few ignored), else
    sizes; returns the means no weighting joins."""
    if label_counts(sample) is not None:
        probe = _with_ignored_labels(sample, 1)
        probes = [_with_ignored_labels(halves[0], 1), *halves[1:]]
        try:
            whole = [padded(t) for t in batch_leaves(run(probe))]
            pieces = [[padded(t) for t in batch_leaves(run(h))] for h in probes]
            sample, halves = probe, probes
        except Exception:  # noqa: BLE001 - a model that cannot take ignored labels: judge the sample as given
            label_free = True
        else:
            label_free = False
    else:
        label_free = True
    if label_free:
        whole = [padded(t) for t in batch_leaves(run(sample))]
        pieces = [[padded(t) for t in batch_leaves(run(h))] for h in halves]
    weights: dict[str, list[int]] = {"mean": [padded(batch_leaves(h)[0]).size(0) for h in halves]}
    found = [label_counts(h) for h in halves]
    if all(c is not None for c in found):
        weights.update({kind: [c[kind] for c in found if c is not None] for kind in ("tokens", "shifted")})
    uneven = []
    for i in means:
        parts = torch.stack([p[i].float() for p in pieces])
        fits = [kind for kind, w in weights.items()
                if close_enough(_weighted(parts, w).to(whole[i].dtype), whole[i])]
        if fits:
            how[i] = fits[0]
        else:
            uneven.append(i)
    return uneven


def warn_uneven(model_name: str, chunks: int, names: Sequence[str]) -> None:
    """Say once (per pipeline built) that these means are not the whole batch's."""
    if names:
        warnings.warn(
            f"dk.Pipeline({model_name}, chunks={chunks}): {', '.join(repr(n) for n in names)} is the mean of the "
            "micro-batches' values weighted by their sizes, which on the sample differs from the whole batch's "
            "(it is not an average over samples or label tokens, e.g. a load-balancing aux_loss); gradients "
            "follow that mean, as gradient accumulation's do: use chunks=1 for the whole batch's",
            PipelineDiffers, stacklevel=6)
