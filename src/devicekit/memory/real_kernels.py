"""Ops whose fake kernel allocates less than the real one, and what the real one allocates.

A fake (meta) kernel gives every output the right shape, but a few real kernels return a
buffer the meta kernel leaves empty, and autograd keeps that buffer alive until the backward:

* ``aten.mkldnn_rnn_layer`` (``nn.LSTM`` on CPU, one call per layer and direction): oneDNN's
  training workspace (gates, states, diff states, each section page-aligned); the meta kernel
  returns 0 bytes. The formula below reproduces oneDNN's layout (``rnn_utils.cpp``) and is
  checked byte for byte against the real kernel in ``tests/memory/test_real_kernels.py``.
* ``aten._cudnn_rnn`` (LSTM, GRU, RNN on CUDA): cuDNN's reserve space; the meta kernel returns
  0 bytes. cuDNN does not document its size: estimated as the gates, cell states and outputs
  of every step of every layer (what the backward needs); not yet checked on a GPU.

GRU and RNN on CPU run the same native ops for real and under fake tensors (compared op by
op in the test), so they need nothing here.

Usage::

    from devicekit.memory.real_kernels import real_outputs

    out = func(*args, **kwargs)                              # inside a dispatch mode, fake
    out = real_outputs(func, args, out)                      # workspaces sized as for real
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cudnn_reserve_bytes", "mkldnn_lstm_workspace_bytes", "real_outputs"]

_PAGE = 4096
_MKLDNN_LSTM = 2                       # the mode number torch passes for an LSTM
_CUDNN_GATES = {0: 1, 1: 1, 2: 4, 3: 3}  # cudnn mode: RNN_RELU, RNN_TANH, LSTM, GRU


def _pages(size: int) -> int:
    return -(-size // _PAGE) * _PAGE


def _good_ld(dim: int) -> int:
    """oneDNN's leading dimension: 64-byte aligned and not a multiple of 256 (4K aliasing)."""
    ld = -(-dim // 16) * 16
    return ld + 16 if ld % 256 == 0 else ld


def mkldnn_lstm_workspace_bytes(steps: int, batch: int, input_size: int, hidden: int) -> int:
    """Bytes of oneDNN's forward-training workspace for one LSTM layer and direction (fp32)."""
    states = 2 * (steps + 1) * batch   # (layers + 1) x (steps + 1) x batch rows
    return (_pages(steps * batch * _good_ld(4 * hidden) * 4)                   # gates
            + 3 * _pages(states * _good_ld(max(input_size, hidden)) * 4)     # states, diff states
            + _pages(steps * batch * _good_ld(hidden) * 4)                   # h per step
            + 2 * _pages(states * hidden * 4))                               # c, diff c


def cudnn_reserve_bytes(steps: int, batch: int, hidden: int, layers: int, directions: int,
                        gates: int, element_size: int) -> int:
    """Estimated bytes of cuDNN's reserve space: every step's gates, cell and output, per layer."""
    per_step = batch * hidden * (gates + 2) * element_size
    return layers * directions * steps * per_step


def _mkldnn_rnn_layer(args: tuple[Any, ...], out: Any) -> Any:
    x, w0, hx = args[0], args[1], args[5]
    mode, hidden, train = args[9], args[10], args[15]
    workspace = out[3]
    if not train or mode != _MKLDNN_LSTM or workspace is None or workspace.numel() > 0:
        return out
    # torch hands the layer a time-major input even when it passes batch_first=True: the
    # batch is hx's first dimension
    batch = int(hx.shape[0])
    steps = x.shape[0] if x.shape[1] == batch else x.shape[1]
    size = mkldnn_lstm_workspace_bytes(int(steps), int(batch), int(w0.shape[1]), int(hidden))
    return (*out[:3], torch.empty(size, dtype=torch.uint8, device=workspace.device))


def _cudnn_rnn(args: tuple[Any, ...], out: Any) -> Any:
    x = args[0]
    mode, hidden, layers, batch_first, train, bidirectional, batch_sizes = (
        args[6], args[7], args[9], args[10], args[12], args[13], args[14])
    reserve = out[3]
    if not train or reserve is None or reserve.numel() > 0:
        return out
    if len(batch_sizes):                    # packed: the steps are the rows of the batch sizes
        steps, batch = len(batch_sizes), int(batch_sizes[0])
    else:
        steps, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
    size = cudnn_reserve_bytes(int(steps), int(batch), int(hidden), int(layers),
                               2 if bidirectional else 1, _CUDNN_GATES.get(int(mode), 4),
                               x.element_size())
    return (*out[:3], torch.empty(size, dtype=torch.uint8, device=reserve.device), *out[4:])


_CORRECTIONS = {
    "aten::mkldnn_rnn_layer": _mkldnn_rnn_layer,
    "aten::_cudnn_rnn": _cudnn_rnn,
}


def real_outputs(func: Any, args: tuple[Any, ...], out: Any) -> Any:
    """``out`` with the buffers the real kernel would return (sized, never filled)."""
    correct = _CORRECTIONS.get(getattr(func, "name", lambda: "")())
    return correct(args, out) if correct is not None else out
