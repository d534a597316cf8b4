"""Ops whose fake kernel allocates less than the real one, and what the real one allocates.

A fake (meta) kernel gives every output the right shape, but a few real kernels return a
buffer the meta kernel leaves empty, and autograd keeps that buffer alive until the backward:

* ``aten.mkldnn_rnn_layer`` (``nn.LSTM`` on CPU, one call per layer and direction): oneDNN's
  training workspace (gates, states, diff states, each section page-aligned); the meta kernel
  returns 0 bytes. The formula below reproduces oneDNN's layout (``rnn_utils.cpp``), in fp32
  and in bf16 (autocast: the gates and states in bf16, the diff states in f32), and is
  checked byte for byte against the real kernel in ``tests/memory/test_real_kernels.py``.
* ``aten.mkldnn_rnn_layer_backward``: the meta kernel returns one tensor for both bias
  gradients, the real kernel two (autograd copied the shared one before accumulating it).
* ``aten._cudnn_rnn`` (LSTM, GRU, RNN on CUDA): cuDNN's reserve space; the meta kernel returns
  0 bytes. cuDNN does not document its size: sized from the H200 measurement
  (:func:`~devicekit.memory.cuda_terms.cudnn_rnn_reserve_bytes`). Its fifth output, the flat
  weight buffer, is None from the meta kernel when the weights are separate tensors (as a fake
  model's are; a real GPU module is flattened by ``.cuda()``): an empty tensor stands in, so the
  backward is not refused for it.
* ``aten._cudnn_rnn_backward`` has no fake kernel at all (torch would run the real cuDNN
  kernel on zero-filled inputs, and fail without the flat weights): :func:`missing_fake_kernel`
  gives its outputs their shapes, and :func:`transient_bytes` the workspace cuDNN allocates
  for the op's duration.

* ``aten._grouped_mm`` (transformers' default mixture-of-experts layers): its meta kernel
  demands bf16, CUDA's rule, while the CPU kernel multiplies fp32 too, so an fp32 MoE on the
  CPU failed on fake tensors only: :func:`missing_fake_kernel` gives the CPU op its output's
  shape (the meta kernel's shape rules) for any other dtype. The shapes do not depend on the
  routing (the groups' offsets are values of a fixed-size tensor).

* ``aten.mse_loss`` and ``aten.smooth_l1_loss`` reduced on the CPU: the real scalar is a view
  into the elementwise loss, as large as the input, kept with the loss through the backward.

GRU and RNN on CPU run the same native ops for real and under fake tensors (compared op by
op in the test), so they need nothing here.

Usage::

    from devicekit.memory.real_kernels import missing_fake_kernel, real_outputs, transient_bytes

    out = missing_fake_kernel(func, args)                    # None: torch has a fake kernel
    out = func(*args, **kwargs) if out is None else out      # inside a dispatch mode, fake
    out = real_outputs(func, args, out)                      # workspaces sized as for real
    extra = transient_bytes(func, args)                      # held only while the op runs
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from devicekit.memory.cuda_terms import cudnn_rnn_reserve_bytes, cudnn_rnn_workspace_bytes

__all__ = ["cudnn_reserve_bytes", "missing_fake_kernel", "mkldnn_lstm_workspace_bytes", "real_outputs",
           "transient_bytes"]

_PAGE = 4096
_MKLDNN_LSTM = 2                       # the mode number torch passes for an LSTM


def _pages(size: int) -> int:
    return -(-size // _PAGE) * _PAGE


def _good_ld(dim: int, element_size: int) -> int:
    """oneDNN's leading dimension (``get_good_ld``), in elements: a multiple of 64 bytes, one
    64 bytes more when a multiple of 256 elements (4K aliasing)."""
    block = 64 // element_size
    ld = -(-dim // block) * block
    return ld + block if ld % 256 == 0 else ld


def mkldnn_lstm_workspace_bytes(steps: int, batch: int, input_size: int, hidden: int,
                                element_size: int = 4) -> int:
    """Bytes of oneDNN's forward-training workspace for one LSTM layer and direction.

    ``element_size`` is the input's: 4 (fp32) or 2 (bf16 under autocast or a bf16 module). The
    gates, the h per step, the h states and the c states are in that type (``gates_t``,
    ``ht_t``, ``src_layer_t``: the source type; torch hands oneDNN c in the input's type too),
    their leading dimensions rounded to 64 bytes in it; the three diff-state sections stay f32
    (``gemm_acc_t``) with the f32 leading dimension, so a bf16 workspace is about 70 % of the
    fp32 one, not half. Each of the seven sections starts on a page. Checked byte for byte
    against the real kernel in fp32 and bf16 (tests/memory/test_real_kernels.py). fp16 would
    take the same layout (``all_f16``), but the CPU kernel refuses an fp16 LSTM on CPUs
    without AVX512-FP16 / AVX2-VNNI-2, and an fp16 module does not reach oneDNN: unchecked.
    """
    e = element_size
    states = 2 * (steps + 1) * batch   # (layers + 1) x (steps + 1) x batch rows
    width = max(input_size, hidden)
    return (_pages(steps * batch * _good_ld(4 * hidden, e) * e)           # gates
            + _pages(steps * batch * _good_ld(hidden, e) * e)             # h per step
            + _pages(states * _good_ld(width, e) * e)                     # h states (layer = iter)
            + _pages(states * hidden * e)                                 # c states
            + 2 * _pages(states * _good_ld(width, 4) * 4)                 # diff h states, f32
            + _pages(states * hidden * 4))                                # diff c states, f32


def cudnn_reserve_bytes(steps: int, batch: int, hidden: int, layers: int, directions: int,
                        mode: int, element_size: int) -> int:
    """Bytes of cuDNN's reserve space (``mode``: 0/1 RNN, 2 LSTM, 3 GRU), as measured on an H200."""
    return cudnn_rnn_reserve_bytes(steps, batch, hidden, layers, directions, mode, element_size)


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
    size = mkldnn_lstm_workspace_bytes(int(steps), int(batch), int(w0.shape[1]), int(hidden),
                                       x.element_size())
    return (*out[:3], torch.empty(size, dtype=torch.uint8, device=workspace.device))


def _mkldnn_rnn_layer_backward(args: tuple[Any, ...], out: Any) -> Any:
    """The real kernel returns the two bias gradients as two tensors; the meta kernel returns one
    tensor twice, so autograd found it referenced twice and copied it before accumulating (and
    torch's fake-tensor cache, on a hit, gives two: the estimate depended on what ran before)."""
    if len(out) > 4 and out[3] is not None and out[3] is out[4]:
        return (*out[:4], torch.empty_like(out[3]), *out[5:])
    return out


def _rnn_shape(x: torch.Tensor, batch_first: bool, batch_sizes: Any) -> tuple[int, int]:
    """(steps, batch) of a cuDNN RNN's input."""
    if len(batch_sizes):                    # packed: the steps are the rows of the batch sizes
        return len(batch_sizes), int(batch_sizes[0])
    return (int(x.shape[1]), int(x.shape[0])) if batch_first else (int(x.shape[0]), int(x.shape[1]))


def _cudnn_rnn(args: tuple[Any, ...], out: Any) -> Any:
    x = args[0]
    mode, hidden, layers, batch_first, train, bidirectional, batch_sizes = (
        args[6], args[7], args[9], args[10], args[12], args[13], args[14])
    reserve, weight_buf = out[3], out[4]
    if weight_buf is None:                  # separate weights: the backward still wants a tensor
        weight_buf = x.new_empty(0)
    if not train or reserve is None or reserve.numel() > 0:
        return (*out[:4], weight_buf, *out[5:])
    steps, batch = _rnn_shape(x, batch_first, batch_sizes)
    size = cudnn_reserve_bytes(steps, batch, int(hidden), int(layers), 2 if bidirectional else 1,
                               int(mode), x.element_size())
    return (*out[:3], torch.empty(size, dtype=torch.uint8, device=reserve.device), weight_buf, *out[5:])


def _like(t: Any) -> Any:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) if t is not None else None


def _cudnn_rnn_backward(args: tuple[Any, ...]) -> Any:
    """(grad input, grad hx, grad cx, grad weights) shaped as cuDNN returns them."""
    x, weights, hx, cx, mask = args[0], args[1], args[4], args[5], args[21]
    return (_like(x) if mask[0] else None, _like(hx) if mask[1] else None,
            _like(cx) if mask[2] and cx is not None else None,
            [_like(w) for w in weights] if mask[3] else [])


def _cudnn_rnn_backward_workspace(args: tuple[Any, ...]) -> int:
    x, grad_output = args[0], args[7]
    mode, hidden, layers, batch_first, bidirectional, batch_sizes = (
        args[10], args[11], args[13], args[14], args[17], args[18])
    steps, batch = _rnn_shape(x, batch_first, batch_sizes)
    size = cudnn_rnn_workspace_bytes(steps, batch, int(hidden), int(layers), 2 if bidirectional else 1,
                                     int(mode), x.element_size())
    grad_hy, grad_cy, mask = args[8], args[9], args[21]
    hx, cx, output = args[4], args[5], args[6]
    if grad_output is None or not grad_output.is_contiguous():   # zeros, or a contiguous copy
        size += _nbytes(output)
    # torch fills the missing grads of the states with zeros, and cuDNN computes every input
    # grad whether it is wanted or not (dropped when the op returns)
    size += (_nbytes(hx) if grad_hy is None else 0) + (_nbytes(cx) if grad_cy is None else 0)
    size += (0 if mask[0] else _nbytes(x)) + (0 if mask[1] else _nbytes(hx)) + (0 if mask[2] else _nbytes(cx))
    return size


def _nbytes(t: Any) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _grouped_mm_on_cpu(args: tuple[Any, ...]) -> Any:
    """The output of ``_grouped_mm(a, b, offs)`` on the CPU in a dtype the meta kernel refuses
    (it accepts bf16 only), shaped as torch's meta kernel shapes it; None otherwise."""
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else None
    out_dtype = args[4] if len(args) > 4 and args[4] is not None else a.dtype
    if not isinstance(a, FakeTensor):                 # a real step (the CPU fallback): run it
        return None
    if a.device.type != "cpu" or a.dtype == torch.bfloat16 or a.dim() not in (2, 3) or b.dim() not in (2, 3):
        return None
    if a.dim() == 2 and b.dim() == 2:
        if offs is None:
            return None
        shape = [offs.shape[0], a.shape[0], b.shape[1]]
    elif a.dim() == 2:
        shape = [a.shape[0], b.shape[-1]]
    elif b.dim() == 2:
        shape = [a.shape[1], b.shape[1]]
    else:
        shape = [a.shape[0], a.shape[1], b.shape[-1]]
    return torch.empty(shape, dtype=out_dtype, device=a.device)


def _reduced_loss_buffer(args: tuple[Any, ...], out: Any) -> Any:
    """``mse_loss`` / ``smooth_l1_loss`` reduced (mean or sum) on the CPU: the real kernel
    returns a 0-d view into the elementwise loss it reduced, so the loss holds a buffer of the
    input's size until it dies (after the backward); the meta kernel returns 4 bytes. (Measured
    on CPU only: on CUDA the fake output is kept.)"""
    source, reduction = args[0], args[2] if len(args) > 2 else 1
    if (not isinstance(out, FakeTensor) or out.dim() != 0 or reduction == 0
            or source.device.type != "cpu" or source.numel() <= 1):
        return out
    buffer = torch.empty(source.numel(), dtype=out.dtype, device=out.device)
    return buffer.as_strided([], [], 0)


_CORRECTIONS = {
    "aten::mse_loss": _reduced_loss_buffer,
    "aten::smooth_l1_loss": _reduced_loss_buffer,
    "aten::mkldnn_rnn_layer": _mkldnn_rnn_layer,
    "aten::mkldnn_rnn_layer_backward": _mkldnn_rnn_layer_backward,
    "aten::_cudnn_rnn": _cudnn_rnn,
}
_MISSING = {"aten::_cudnn_rnn_backward": _cudnn_rnn_backward, "aten::_grouped_mm": _grouped_mm_on_cpu}
_TRANSIENT = {"aten::_cudnn_rnn_backward": _cudnn_rnn_backward_workspace}


def _name(func: Any) -> str:
    return getattr(func, "name", lambda: "")()


def real_outputs(func: Any, args: tuple[Any, ...], out: Any) -> Any:
    """``out`` with the buffers the real kernel would return (sized, never filled)."""
    correct = _CORRECTIONS.get(_name(func))
    return correct(args, out) if correct is not None else out


def missing_fake_kernel(func: Any, args: tuple[Any, ...]) -> Any:
    """The outputs of an op torch has no fake kernel for (empty tensors of the real shapes), or
    None: call the op."""
    make = _MISSING.get(_name(func))
    return make(args) if make is not None else None


def transient_bytes(func: Any, args: tuple[Any, ...]) -> int:
    """Bytes the real kernel allocates beyond its outputs and frees before it returns."""
    size = _TRANSIENT.get(_name(func))
    return size(args) if size is not None else 0
