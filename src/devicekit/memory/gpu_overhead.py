"""What a GPU process holds beyond the bytes its tensors use: the range nvidia-smi will show.

The step's peak is what the caching allocator hands out (``max_memory_allocated``). On top,
``nvidia-smi`` shows: what the allocator keeps reserved beyond that (its segments are rounded
to 2 MiB, blocks between 1 and 10 MiB come from 20 MiB segments, and freed blocks that do
not fit the next request stay reserved: fragmentation), the CUDA context (driver, kernels of
torch loaded lazily), and the cuBLAS / cuDNN workspaces. None of these is measured here; the
figures are the ones torch documents (cuBLAS: 32 MiB per handle on Hopper, 8 MiB + 1 MiB
before) and common observation (context 300-600 MiB with lazy module loading), which is why
the answer is a range: ``low`` assumes a tight allocator and a small context, ``high`` a
fragmented one, a large context and cuDNN's convolution workspace.

Usage::

    from devicekit.memory.gpu_overhead import gpu_range

    low, expected, high = gpu_range(peak_bytes, convolutions=True, hopper=True)
"""

from __future__ import annotations

__all__ = ["CONTEXT", "gpu_range", "reserved_for"]

_MIB = 1 << 20
#: CUDA context with lazy module loading: (low, expected, high)
CONTEXT = (300 * _MIB, 450 * _MIB, 650 * _MIB)
_FRAGMENTATION = (1.0, 1.08, 1.25)           # reserved / allocated at the peak
_CUDNN_CONV_WORKSPACE = 256 * _MIB            # high end only: cuDNN benchmark may pick big ones


def reserved_for(allocated: int) -> int:
    """The reserved bytes a tight caching allocator needs for ``allocated``: 2 MiB segments."""
    return -(-allocated // (2 * _MIB)) * (2 * _MIB)


def gpu_range(peak: int, *, convolutions: bool = False, hopper: bool = False) -> tuple[int, int, int]:
    """(low, expected, high) bytes nvidia-smi shows for a process whose step peaks at ``peak``."""
    cublas = 32 * _MIB if hopper else 9 * _MIB
    low = reserved_for(peak) + CONTEXT[0] + cublas
    expected = reserved_for(int(peak * _FRAGMENTATION[1])) + CONTEXT[1] + cublas
    high = (reserved_for(int(peak * _FRAGMENTATION[2])) + CONTEXT[2] + cublas
            + (_CUDNN_CONV_WORKSPACE if convolutions else 0))
    return low, expected, high
