"""Cut a mini-batch into micro-batches and join the outputs back; move activations between devices.

A batch is a tensor or a tuple/list of tensors cut along dimension 0 (``torch.chunk``, so the
last micro-batch may be smaller and a batch smaller than ``chunks`` gives fewer micro-batches).
Other values in a tuple (flags, ints) are handed unchanged to every micro-batch.

Usage::

    import torch
    from devicekit.parallel.microbatch import scatter, gather, move

    parts = scatter(torch.arange(10), chunks=4)   # sizes 3, 3, 3, 1
    gather(parts)                                 # tensor([0, ..., 9])
    move((x, mask), torch.device("cuda:1"))       # every tensor inside, autograd-tracked
"""

from __future__ import annotations

from typing import Any

import torch

from devicekit.errors import InvalidValueError

__all__ = ["scatter", "gather", "move"]


def move(obj: Any, device: torch.device) -> Any:
    """Every tensor in ``obj`` (nested tuple/list/dict) on ``device``; ``.to`` keeps autograd."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, tuple):
        return tuple(move(o, device) for o in obj)
    if isinstance(obj, list):
        return [move(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: move(v, device) for k, v in obj.items()}
    return obj


def scatter(batch: Any, chunks: int) -> list[Any]:
    """Cut ``batch`` into at most ``chunks`` micro-batches along dimension 0."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            raise InvalidValueError("batch is a 0-d tensor; a pipeline cuts batches along dimension 0")
        return list(batch.chunk(chunks))
    if isinstance(batch, (tuple, list)):
        tensors = [b for b in batch if isinstance(b, torch.Tensor)]
        if not tensors:
            raise InvalidValueError(f"batch of {type(batch).__name__} holds no tensor to cut into micro-batches")
        sizes = {t.size(0) if t.dim() else None for t in tensors}
        if len(sizes) != 1 or None in sizes:
            raise InvalidValueError(
                f"batch tensors have different first dimensions {sorted(s for s in sizes if s is not None)}; "
                "every tensor of a batch must have the same batch size on dimension 0"
            )
        pieces = [b.chunk(chunks) if isinstance(b, torch.Tensor) else None for b in batch]
        count = len(next(p for p in pieces if p is not None))
        out = []
        for i in range(count):
            item = [p[i] if p is not None else b for p, b in zip(pieces, batch, strict=True)]
            out.append(tuple(item) if isinstance(batch, tuple) else item)
        return out
    raise InvalidValueError(
        f"batch of type {type(batch).__name__} cannot be cut into micro-batches; pass a tensor or a tuple of tensors"
    )


def gather(outputs: list[Any]) -> Any:
    """Join micro-batch outputs along dimension 0 (tensors, or tuples/lists of tensors)."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs) if len(outputs) > 1 else first
    if isinstance(first, (tuple, list)):
        joined = [gather([o[i] for o in outputs]) if isinstance(first[i], torch.Tensor) else first[i]
                  for i in range(len(first))]
        return tuple(joined) if isinstance(first, tuple) else joined
    raise InvalidValueError(
        f"a part returned {type(first).__name__}; pipeline outputs must be tensors or tuples of tensors"
    )
