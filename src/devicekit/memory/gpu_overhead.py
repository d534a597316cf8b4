"""What a GPU process holds beyond the bytes its tensors use: the range nvidia-smi will show.

The step's peak is what the caching allocator hands out (``max_memory_allocated``); a CUDA
estimate already holds cuBLAS's workspaces in it (:mod:`.cuda_terms`). On top, nvidia-smi
shows what the allocator keeps reserved beyond that (2 MiB and 20 MiB segments, freed blocks
that do not fit the next request) and the CUDA context with the libraries' code (cuBLAS, cuDNN,
torch's kernels, loaded lazily). The figures are the ones measured on an H200 (see
:data:`~devicekit.memory.cuda_terms.FIGURES`): nvidia-smi was 812-834 MiB above
``max_memory_reserved``, and reserved was 4-75 MiB (up to x1.51 for small steps) above
allocated. ``low`` also allows for an estimate 10 % over the truth, ``high`` for one 5 % under,
a fragmented allocator and, with convolutions, cuDNN's workspaces (not sized in the peak).

Usage::

    from devicekit.memory.gpu_overhead import gpu_range

    low, expected, high = gpu_range(peak_bytes, convolutions=True, workspaces_counted=True)
"""

from __future__ import annotations

from devicekit.memory.cuda_terms import CONTEXT_BEYOND_RESERVED, cublas_workspace_bytes

__all__ = ["CONTEXT", "gpu_range", "reserved_for"]

_MIB = 1 << 20
#: CUDA context and libraries, beyond what the allocator reserves: (low, expected, high)
CONTEXT = (CONTEXT_BEYOND_RESERVED[0] - 12 * _MIB, CONTEXT_BEYOND_RESERVED[1], CONTEXT_BEYOND_RESERVED[2] + 66 * _MIB)
#: reserved beyond allocated at the peak: (factor, bytes) for expected and high
_RESERVE_EXPECTED = (1.0, 24 * _MIB)
_RESERVE_HIGH = (1.15, 80 * _MIB)
#: how far the estimate may be from the truth (the goal): 10 % over, 5 % under
_OVER, _UNDER = 0.10, 0.05
_CUDNN_CONV_WORKSPACE = 256 * _MIB            # high end only: not sized in the peak (assumed)


def reserved_for(allocated: int) -> int:
    """The reserved bytes a tight caching allocator needs for ``allocated``: 2 MiB segments."""
    return -(-allocated // (2 * _MIB)) * (2 * _MIB)


def gpu_range(peak: int, *, convolutions: bool = False, hopper: bool = False,
              workspaces_counted: bool = False) -> tuple[int, int, int]:
    """(low, expected, high) bytes nvidia-smi shows for a process whose step peaks at ``peak``.

    ``workspaces_counted``: the peak already holds cuBLAS's workspaces (a CUDA estimate); else
    two are added (the caller's thread and autograd's), 32 MiB each on ``hopper`` and newer.
    """
    if not workspaces_counted:
        peak += 2 * cublas_workspace_bytes(9 if hopper else 8)
    low = reserved_for(int(peak / (1 + _OVER))) + CONTEXT[0]
    expected = reserved_for(int(peak * _RESERVE_EXPECTED[0]) + _RESERVE_EXPECTED[1]) + CONTEXT[1]
    high = (reserved_for(int(peak / (1 - _UNDER) * _RESERVE_HIGH[0]) + _RESERVE_HIGH[1]) + CONTEXT[2]
            + (_CUDNN_CONV_WORKSPACE if convolutions else 0))
    return low, expected, high
