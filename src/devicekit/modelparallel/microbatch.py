"""Cut a mini-batch into micro-batches and join the outputs back; move activations between devices.

A batch is any nested structure ``to_device`` takes (tensors in tuples, lists, dicts,
namedtuples, dataclasses, ...): every tensor in it is cut along dimension 0 (``torch.chunk``,
so the last micro-batch may be smaller and a batch smaller than ``chunks`` gives fewer
micro-batches), and every micro-batch has the batch's own structure; other values (flags, ints,
strings) are handed unchanged to every micro-batch. A ``PackedSequence`` is cut by sequences
(unpacked, cut, packed again with its lengths). Outputs are joined the same way, along
dimension 0 unless ``dims`` says otherwise per output (an LSTM's ``h_n`` has the batch on
dimension 1; a value every micro-batch shares, such as a mask, is taken once). The walk is
:func:`devicekit.placement.walk.map_tensors`' :class:`~devicekit.placement.walk.Walk`, the
package's one tree map, so a namedtuple activation stays a namedtuple between stages, and
:func:`move` moves what ``to_device`` moves (objects with a ``.to()``, a ``PackedSequence`` too).

Usage::

    import torch
    from devicekit.modelparallel.microbatch import scatter, gather, move

    parts = scatter(torch.arange(10), chunks=4)   # sizes 3, 3, 3, 1
    gather(parts)                                 # tensor([0, ..., 9])
    gather([(y0, h0), (y1, h1)], dims=[0, 1])     # h joined on dimension 1
    move((x, mask), torch.device("cuda:1"))       # every tensor inside, autograd-tracked
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from devicekit.errors import InvalidValueError
from devicekit.placement.walk import Walk

__all__ = ["scatter", "gather", "move", "batch_leaves", "padded", "map_leaves"]

Leaf = torch.Tensor | PackedSequence


def _keep_module(walk: Walk, module: nn.Module) -> nn.Module:
    return module


def _map_leaves(obj: Any, fn: Callable[[Leaf], Any]) -> Any:
    """``obj`` rebuilt with ``fn`` applied to each tensor and each PackedSequence (other objects kept)."""
    def on_object(walk: Walk, o: Any) -> Any:
        return fn(o) if isinstance(o, PackedSequence) else o

    return Walk(None, lambda walk, t: fn(t), on_object, _keep_module, frozenset())(obj)


map_leaves = _map_leaves  # public name: rebuild ``obj`` around new tensors (output_join uses it)


def batch_leaves(obj: Any) -> list[Leaf]:
    """The tensors and PackedSequences of ``obj`` in walk order, each once."""
    found: list[Leaf] = []

    def visit(leaf: Leaf) -> Leaf:
        found.append(leaf)
        return leaf

    _map_leaves(obj, visit)
    return found


def padded(leaf: Leaf) -> torch.Tensor:
    """A tensor as it is; a PackedSequence as its padded batch-first tensor (batch on dimension 0)."""
    if isinstance(leaf, PackedSequence):
        return pad_packed_sequence(leaf, batch_first=True)[0]
    return leaf


def _batch_size(leaf: Leaf) -> int:
    if isinstance(leaf, PackedSequence):
        return int(leaf.batch_sizes[0]) if leaf.batch_sizes.numel() else 0
    return leaf.size(0)


def move(obj: Any, device: torch.device) -> Any:
    """Every tensor in ``obj`` (any nested structure) on ``device``; ``.to`` keeps autograd.

    Objects with a ``.to()`` (a ``PackedSequence``, whose lengths stay on the CPU) are moved by it."""
    def on_tensor(walk: Walk, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == device else t.to(device)

    def on_object(walk: Walk, o: Any) -> Any:
        to = getattr(o, "to", None)
        moved = to(device) if callable(to) else None
        return o if moved is None else moved

    return Walk(device, on_tensor, on_object, _keep_module, frozenset())(obj)


def _cut_packed(seq: PackedSequence, chunks: int) -> list[PackedSequence]:
    values, lengths = pad_packed_sequence(seq, batch_first=True)
    return [pack_padded_sequence(v, n, batch_first=True, enforce_sorted=False)
            for v, n in zip(values.chunk(chunks), lengths.chunk(chunks), strict=True)]


def _join_packed(parts: Sequence[PackedSequence]) -> PackedSequence:
    unpacked = [pad_packed_sequence(p, batch_first=True) for p in parts]
    longest = max(int(n.max()) for _, n in unpacked)
    values = [v if v.size(1) == longest else torch.nn.functional.pad(
        v, (0, 0) * (v.dim() - 2) + (0, longest - v.size(1))) for v, _ in unpacked]
    return pack_padded_sequence(torch.cat(values), torch.cat([n for _, n in unpacked]), batch_first=True,
                                enforce_sorted=False)


def scatter(batch: Any, chunks: int) -> list[Any]:
    """Cut ``batch`` into at most ``chunks`` micro-batches along dimension 0."""
    leaves = batch_leaves(batch)
    if not leaves:
        raise InvalidValueError(
            f"batch of type {type(batch).__name__} holds no tensor to cut into micro-batches; "
            "pass a tensor or a structure of tensors")
    if any(isinstance(t, torch.Tensor) and t.dim() == 0 for t in leaves):
        raise InvalidValueError("batch holds a 0-d tensor; a pipeline cuts batches along dimension 0")
    sizes = {_batch_size(t) for t in leaves}
    if len(sizes) != 1:
        raise InvalidValueError(
            f"batch tensors have different first dimensions {sorted(sizes)}; "
            "every tensor of a batch must have the same batch size on dimension 0")
    pieces = {id(t): _cut_packed(t, chunks) if isinstance(t, PackedSequence) else t.chunk(chunks) for t in leaves}
    count = len(pieces[id(leaves[0])])
    return [_map_leaves(batch, lambda t, i=i: pieces[id(t)][i]) for i in range(count)]


def gather(outputs: list[Any], dims: Sequence[int | None] | None = None) -> Any:
    """Join micro-batch outputs, keeping the outputs' structure.

    ``dims``: per output tensor (walk order) the dimension that holds the batch (default 0), or
    None for a value every micro-batch shares (the first micro-batch's is returned)."""
    first = outputs[0]
    if len(outputs) == 1:
        return first
    columns = [batch_leaves(o) for o in outputs]
    if not columns[0]:
        raise InvalidValueError(
            f"a part returned {type(first).__name__} with no tensor in it; pipeline outputs must "
            "hold tensors")
    if any(len(c) != len(columns[0]) for c in columns):
        raise InvalidValueError("micro-batch outputs differ in structure; a part must return the "
                                "same structure for every micro-batch")
    if dims is not None and len(dims) != len(columns[0]):
        raise InvalidValueError(f"gather: {len(dims)} batch dimensions given for {len(columns[0])} outputs")
    joined = []
    for i, parts in enumerate(zip(*columns, strict=True)):
        dim = 0 if dims is None else dims[i]
        if dim is None:
            joined.append(parts[0])
        elif isinstance(parts[0], PackedSequence):
            joined.append(_join_packed(parts))
        else:
            joined.append(torch.cat(parts, dim=dim))
    found = iter(joined)
    return _map_leaves(first, lambda t: next(found))
