"""Sparse outputs whose fake kernel gets the number of stored elements wrong, made right.

A sparse COO tensor holds ``nnz`` indices and values; how many depends on values, so a fake
kernel has to guess, and torch's fake kernels guess 0 where the real kernel keeps them all:

* ``aten.clone`` of a sparse tensor comes back empty under fake tensors, so every sparse
  gradient, and all an optimizer made from it, weighed nothing: an ``nn.EmbeddingBag(sparse=True)``
  model read 96 % low. The clone keeps the input's ``nnz``, as the real one does; and where
  AccumulateGrad clones a sparse gradient only because a dispatch mode is watching (real and
  fake steps alike), the gradient is stolen instead, as it is in a loop nobody watches.
* the sparse backward of ``nn.Embedding`` / ``nn.EmbeddingBag`` (``sparse=True``) stores one row
  of values per id looked up (uncoalesced; the ids at ``padding_idx`` excepted, so this is at
  most a few rows high): ``nnz`` is the number of ids.

* ``aten._coalesce`` (SparseAdam and Adagrad coalesce each sparse gradient) comes back empty
  too; the real one keeps one element per distinct index: at most the input's ``nnz``, and at
  most one per row of the table, which is what it is given (exact once every row is hit, high
  by the repeats otherwise, never low), in storages as large as the input's.

* ``aten.sparse_mask(dense, mask)`` (Adagrad's sparse step) keeps the mask's ``nnz``; its fake
  kernel returned an empty one, and the step failed on fake tensors.

Every other sparse op keeps the ``nnz`` its fake kernel derives from its inputs (a sparse
tensor built from indices and values, theirs).

Usage (inside a dispatch mode over fake tensors, as :mod:`.fake_step` does)::

    from devicekit.memory.sparse_kernels import sparse_outputs

    out = sparse_outputs(func, args, out)      # fake or real tensors
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["sparse_outputs"]


def _coo(like: torch.Tensor, nnz: int, values_dtype: torch.dtype | None = None,
         coalesced: bool = False, capacity: int | None = None) -> torch.Tensor:
    """A sparse COO tensor shaped as ``like`` with ``nnz`` stored elements, in storages for
    ``capacity`` (default ``nnz``) of them (under fake tensors: a fake one; nothing is filled)."""
    sparse_dim, dense_dim = like.sparse_dim(), like.dense_dim()
    room = max(capacity or nnz, nnz)
    indices = torch.empty((sparse_dim, room), dtype=torch.long, device=like.device).narrow(1, 0, nnz)
    values = torch.empty((room, *like.shape[sparse_dim:]), dtype=values_dtype or like.dtype,
                         device=like.device).narrow(0, 0, nnz)
    return torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
        sparse_dim, dense_dim, list(like.shape), indices, values, dtype=like.dtype, layout=torch.sparse_coo,
        device=like.device, is_coalesced=coalesced)


def _accumulating() -> bool:
    node = torch._C._current_autograd_node()
    return node is not None and node.name() == "torch::autograd::AccumulateGrad"


def _clone(args: tuple[Any, ...], out: Any) -> Any:
    """AccumulateGrad steals a sparse gradient whose indices and values are contiguous; only a
    dispatch mode (this estimate's, or a tracker's) makes it clone, so the stolen one is what
    a real step holds (the CPU allocator's record: 17.6 MiB, not the 33.2 MiB a mode sees)."""
    source = args[0]
    if (source.layout == torch.sparse_coo and _accumulating() and source._indices().is_contiguous()
            and source._values().is_contiguous()):
        return torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
            source.sparse_dim(), source.dense_dim(), list(source.shape), source._indices(), source._values(),
            dtype=source.dtype, layout=torch.sparse_coo, device=source.device,
            is_coalesced=source.is_coalesced())
    return _same_nnz(args, out) if isinstance(out, FakeTensor) else out


def _same_nnz(args: tuple[Any, ...], out: Any) -> Any:
    source = args[0]
    if source.layout != torch.sparse_coo or out.layout != torch.sparse_coo or out._nnz() >= source._nnz():
        return out
    return _coo(out, source._nnz(), coalesced=source.is_coalesced())


def _coalesced(args: tuple[Any, ...], out: Any) -> Any:
    """Coalescing sums repeated indices: at most the input's ``nnz``, and at most one per place;
    the real kernel keeps the storages it made for the input's ``nnz`` (its output is narrowed,
    not copied: 8 MiB of values behind 1000 rows of a 1000-row table hit by 32768 ids)."""
    source = args[0]
    places = 1
    for size in source.shape[:source.sparse_dim()]:
        places *= int(size)
    nnz = min(source._nnz(), places)
    return out if out._nnz() >= nnz else _coo(out, nnz, coalesced=True, capacity=source._nnz())


def _ids_looked_up(indices: Any, out: Any) -> Any:
    if not isinstance(out, torch.Tensor) or out.layout != torch.sparse_coo or out._nnz() >= indices.numel():
        return out
    return _coo(out, indices.numel())


_CLONE = torch.ops.aten.clone.default
_FIXES = {
    "aten::clone": _clone,
    "aten::_to_copy": _same_nnz,
    "aten::_coalesce": _coalesced,
    "aten::sparse_mask": lambda args, out: _same_nnz(args[1:], out),
    "aten::_embedding_bag_backward": lambda args, out: _ids_looked_up(args[1], out),
    "aten::_embedding_bag_sparse_backward": lambda args, out: _ids_looked_up(args[1], out),
    "aten::embedding_backward": lambda args, out: _ids_looked_up(args[1], out),
    "aten::embedding_sparse_backward": lambda args, out: _ids_looked_up(args[1], out),
}


def sparse_outputs(func: Any, args: tuple[Any, ...], out: Any) -> Any:
    """``out``, or, for a fake sparse output of an op in the table, one with the real ``nnz``."""
    if not isinstance(out, torch.Tensor) or out.layout == torch.strided:
        return out
    if func is _CLONE:
        return _clone(args, out)
    fix = _FIXES.get(func.name()) if isinstance(out, FakeTensor) else None
    return fix(args, out) if fix is not None else out
