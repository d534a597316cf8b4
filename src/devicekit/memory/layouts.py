"""The strided tensors behind a tensor of any layout: what its memory is made of.

A dense (strided) tensor is its storage. A sparse one has no storage of its own: it holds
index and value tensors (COO: indices and values; CSR / BSR: crow indices, column indices,
values; CSC / BSC: column pointers, row indices, values); a jagged nested tensor holds its
values and offsets; a quantized one is strided, with per-channel scales and zero points beside
it. The estimate counts these pieces; a layout none of them describes (oneDNN's opaque
``torch._mkldnn``) is refused by name rather than counted as nothing.

Usage::

    from devicekit.memory.layouts import pieces

    for piece in pieces(tensor):         # strided tensors; raises UnsizedLayoutError
        count(piece.untyped_storage())
"""

from __future__ import annotations

import torch

from devicekit.errors import InvalidValueError

__all__ = ["UnsizedLayoutError", "pieces"]


class UnsizedLayoutError(InvalidValueError):
    """A tensor whose layout the estimate cannot size (it names the layout)."""


def pieces(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The strided tensors whose storages hold ``tensor``'s bytes (``[tensor]`` when strided)."""
    layout = tensor.layout
    if layout == torch.strided:
        if tensor.is_quantized and tensor.qscheme() in (torch.per_channel_affine,
                                                        torch.per_channel_affine_float_qparams):
            return [tensor, tensor.q_per_channel_scales(), tensor.q_per_channel_zero_points()]
        return [tensor]
    if layout == torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    if layout == torch.jagged:
        found = [getattr(tensor, name, None) for name in ("_values", "_offsets", "_lengths")]
        return [t for t in found if isinstance(t, torch.Tensor)]
    raise UnsizedLayoutError(
        f"a tensor of layout {layout} (shape {tuple(tensor.shape)}) is made in the step, and the "
        "estimate cannot size that layout; estimate the model without it (e.g. without "
        "to_mkldnn), or measure the step")
