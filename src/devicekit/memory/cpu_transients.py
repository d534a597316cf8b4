"""What a CPU kernel allocates while it runs and frees before it returns, beyond its outputs.

A dispatch mode sees each op's outputs, not the buffers its kernel holds inside, and on the CPU
one kind of kernel holds a lot: oneDNN's convolutions (``nn.Conv1d/2d/3d`` on CPU) reorder the
input, the weight and the output into channel-blocked layouts (channels padded to a block of
8 or 16) and back, and the backward does the same with the gradients. Measured with torch's
profiler on diffusers' UNets and VAEs (the allocator's record against the tensors the ops
return): forward 1.0-1.3x the input and weight, up to 8x the output for a one-channel filter
(a FIR up/down-sampler: 256 KiB out, 2 MiB held inside), backward 1.0-1.1x the output gradient
and the input, up to 7x for the one-channel filter; unmodelled, a skip-block UNet read 9 % low
against the allocator and a VAE's eval loop 7 %.

What is held, for the op's duration: in the forward the larger of the input and weight
together and the output with its channels padded to oneDNN's block (8 on AVX2, 16 on AVX-512),
only the padded output where the input has fewer channels than a block (an RGB stem, a ViT's
patches: measured, no input reorder);
in the backward the output gradient and the input, both padded, and the weight. That matches the
measurements above to within 10 % of each op's transient, above rather than below (oneDNN's
per-thread scratchpads grow with the thread count: not modelled).

Usage (inside a dispatch mode, as :mod:`.fake_step` does on a CPU target)::

    from devicekit.memory.cpu_transients import cpu_transient_bytes

    extra = cpu_transient_bytes(func, args, out)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cpu_transient_bytes"]

_BLOCK = 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8
_CONVOLUTION = torch.ops.aten.convolution.default
_CONVOLUTION_BACKWARD = torch.ops.aten.convolution_backward.default


def _blocked(t: Any, channels_dim: int = 1) -> int:
    """Bytes of ``t`` with dimension ``channels_dim`` padded to a multiple of the block."""
    if not isinstance(t, torch.Tensor) or t.dim() <= channels_dim:
        return 0
    channels = t.shape[channels_dim]
    padded = -(-channels // _BLOCK) * _BLOCK
    return t.numel() // max(channels, 1) * padded * t.element_size()


def _plain(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def cpu_transient_bytes(func: Any, args: tuple[Any, ...], out: Any) -> int:
    """Bytes a CPU kernel holds while it runs (0 for an op not modelled or not on the CPU);
    ``out``: what the op returned."""
    if func is _CONVOLUTION:
        x, weight = args[0], args[1]
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dim() < 3:
            return 0
        if x.shape[1] < _BLOCK:          # a few input channels: the output is reordered
            return _blocked(out)
        return max(_plain(x) + _plain(weight), _blocked(out))
    if func is _CONVOLUTION_BACKWARD:
        grad_out, x, weight = args[0], args[1], args[2]
        if not isinstance(x, torch.Tensor) or x.device.type != "cpu" or x.dim() < 3:
            return 0
        return _blocked(grad_out) + _blocked(x) + _plain(weight)
    return 0
