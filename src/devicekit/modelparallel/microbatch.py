"""Cut a mini-batch into micro-batches and join the outputs back; move activations between devices.

A batch is any nested structure ``to_device`` takes (tensors in tuples, lists, dicts,
namedtuples, dataclasses, ...): every tensor in it is cut along dimension 0 (``torch.chunk``,
so the last micro-batch may be smaller and a batch smaller than ``chunks`` gives fewer
micro-batches), and every micro-batch has the batch's own structure; other values (flags, ints,
strings) are handed unchanged to every micro-batch. Outputs are joined the same way. The walk is
:func:`devicekit.placement.walk.map_tensors`, the package's one tree map, so a namedtuple
activation stays a namedtuple between stages.

Usage::

    import torch
    from devicekit.modelparallel.microbatch import scatter, gather, move

    parts = scatter(torch.arange(10), chunks=4)   # sizes 3, 3, 3, 1
    gather(parts)                                 # tensor([0, ..., 9])
    move((x, mask), torch.device("cuda:1"))       # every tensor inside, autograd-tracked
"""

from __future__ import annotations

from typing import Any

import torch

from devicekit.errors import InvalidValueError
from devicekit.placement.walk import map_tensors

__all__ = ["scatter", "gather", "move"]


def move(obj: Any, device: torch.device) -> Any:
    """Every tensor in ``obj`` (any nested structure) on ``device``; ``.to`` keeps autograd."""
    return map_tensors(obj, lambda t: t if t.device == device else t.to(device))


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj`` in walk order, each once (the order map_tensors visits them)."""
    found: list[torch.Tensor] = []

    def visit(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    map_tensors(obj, visit)
    return found


def scatter(batch: Any, chunks: int) -> list[Any]:
    """Cut ``batch`` into at most ``chunks`` micro-batches along dimension 0."""
    tensors = _tensors(batch)
    if not tensors:
        raise InvalidValueError(
            f"batch of type {type(batch).__name__} holds no tensor to cut into micro-batches; "
            "pass a tensor or a structure of tensors")
    if any(t.dim() == 0 for t in tensors):
        raise InvalidValueError("batch holds a 0-d tensor; a pipeline cuts batches along dimension 0")
    sizes = {t.size(0) for t in tensors}
    if len(sizes) != 1:
        raise InvalidValueError(
            f"batch tensors have different first dimensions {sorted(sizes)}; "
            "every tensor of a batch must have the same batch size on dimension 0")
    pieces = {id(t): t.chunk(chunks) for t in tensors}
    count = len(pieces[id(tensors[0])])
    return [map_tensors(batch, lambda t, i=i: pieces[id(t)][i]) for i in range(count)]


def gather(outputs: list[Any]) -> Any:
    """Join micro-batch outputs along dimension 0, keeping the outputs' structure."""
    first = outputs[0]
    if len(outputs) == 1:
        return first
    columns = [_tensors(o) for o in outputs]
    if not columns[0]:
        raise InvalidValueError(
            f"a part returned {type(first).__name__} with no tensor in it; pipeline outputs must "
            "hold tensors")
    if any(len(c) != len(columns[0]) for c in columns):
        raise InvalidValueError("micro-batch outputs differ in structure; a part must return the "
                                "same structure for every micro-batch")
    joined = iter([torch.cat(parts) for parts in zip(*columns, strict=True)])
    return map_tensors(first, lambda t: next(joined))
