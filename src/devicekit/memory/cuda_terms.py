"""What CUDA adds beyond the tensors a step makes: one table, each figure with where it came from.

A step on a GPU allocates more than its tensors. Some of it goes through torch's caching
allocator and so counts in ``torch.cuda.max_memory_allocated`` (cuBLAS workspaces, cuDNN's RNN
reserve space and its workspaces); the rest only shows in nvidia-smi (the CUDA context, the
libraries' code, what the allocator keeps reserved). :data:`FIGURES` lists every term with its
size and its source (a line of a measured log, or torch's source), so that the next GPU run can
correct a figure in one place. The functions below turn the figures into bytes for a step from
the ops it runs (the fake step's dispatch mode sees every one), not from its module types.

Measured on an NVIDIA H200 (sm90), torch 2.11.0+cu130, cuDNN 9.19, CUDA 13.0; logs in the
project's ``shared/gpu-runs/2026-11-28-h200/``. torch's own behaviour moves between versions
(cuBLASLt's workspace was unified with cuBLAS's by default in 2026; later versions let cuBLAS
keep its workspace outside the caching allocator), so every size can be overridden the way
torch reads it: ``CUBLAS_WORKSPACE_CONFIG``, ``CUBLASLT_WORKSPACE_SIZE``,
``TORCH_CUBLASLT_UNIFIED_WORKSPACE``.

Usage::

    from devicekit.memory.cuda_terms import FIGURES, BlasWorkspaces, cublas_workspace_bytes

    for figure in FIGURES:
        print(figure.name, figure.size, figure.counts_in, figure.source)
    blas = BlasWorkspaces(cublas_workspace_bytes(major=9, env={}))
    blas.added("aten::mm", backward=False)     # 32 MiB: the first matmul on the caller's thread
    blas.added("aten::mm", backward=True)      # 32 MiB more: autograd's thread has its own handle
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["BLAS_OPS", "CONTEXT_BEYOND_RESERVED", "CONTEXT_AFTER_INIT", "FIGURES", "LT_OPS",
           "BlasWorkspaces", "CudaFigure", "blas_workspaces_here", "cublas_workspace_bytes", "cublaslt_extra_bytes",
           "cudnn_rnn_reserve_bytes", "cudnn_rnn_workspace_bytes"]

_KIB, _MIB = 1 << 10, 1 << 20
_LOG = "shared/gpu-runs/2026-11-28-h200"
_TORCH_BLAS = "torch aten/src/ATen/cuda/CublasHandlePool.cpp"


@dataclass(frozen=True)
class CudaFigure:
    """One term: what it is, how big, where it counts, and where the figure came from."""

    name: str
    size: str
    counts_in: str          # "allocated" (max_memory_allocated and nvidia-smi) or "nvidia-smi"
    source: str
    used: str               # how the estimate uses it


#: cuBLAS's workspace per (thread, stream) where torch does not say otherwise
CUBLAS_DEFAULT = 32 * _MIB                       # sm90 (Hopper) to sm12x (Blackwell)
CUBLAS_DEFAULT_OLDER = 4096 * _KIB * 2 + 16 * _KIB * 8   # ":4096:2:16:8", sm < 90: 8 MiB + 128 KiB
#: cuBLASLt's own workspace when it is not unified with cuBLAS's (torch's default 1024 KiB)
CUBLASLT_DEFAULT = 1024 * _KIB
#: the CUDA context right after torch.cuda.init() (nvidia-smi, this process)
CONTEXT_AFTER_INIT = 518 * _MIB
#: nvidia-smi minus max_memory_reserved once cuBLAS and cuDNN are loaded: (least, typical, most)
CONTEXT_BEYOND_RESERVED = (812 * _MIB, 830 * _MIB, 834 * _MIB)

#: cuDNN RNN, per layer and direction, in units of steps x batch x hidden x element size
_RNN_RESERVE = {"lstm": 5.5, "gru": 4.25, "rnn": 2.0}
_RNN_BACKWARD_WORKSPACE = {"lstm": 4.1, "gru": 4.7, "rnn": 2.0}
_CUDNN_MODES = {0: "rnn", 1: "rnn", 2: "lstm", 3: "gru"}   # cudnnRNNMode_t as torch passes it

FIGURES: tuple[CudaFigure, ...] = (
    CudaFigure("cuBLAS workspace, per thread and stream",
               "32 MiB on sm90-sm12x; 8 MiB + 128 KiB (':4096:2:16:8') before; CUBLAS_WORKSPACE_CONFIG "
               "':SIZE_KIB:COUNT' pairs when set", "allocated",
               f"{_LOG}/facts2.log:3 ('fp32 matmul: extra allocated MiB 32.0'), :7 (a second stream: "
               f"32.0 more); {_TORCH_BLAS} parseChosenWorkspaceSize",
               "added to the peak once the step runs a matmul on that thread (kept for good), in any "
               "dtype: a bf16 matmul uses the same workspace (facts2.log:4, 0 extra)"),
    CudaFigure("cuBLAS workspace of autograd's thread", "the same again", "allocated",
               f"{_LOG}/facts2.log:5 ('linear fwd+bwd: allocated delta MiB 37.25': 32 MiB + the grads); "
               f"{_LOG}/pytest-gpu.log:14-211 (every estimate 66 MiB under: 2 x 32 MiB + 2 MiB unexplained)",
               "added once the backward runs a matmul (CUDA's backward runs on its own thread, "
               "whose cuBLAS handle gets its own workspace)"),
    CudaFigure("cuBLASLt workspace", "0 when unified with cuBLAS's (torch's default since 2026); "
               "CUBLASLT_WORKSPACE_SIZE KiB (default 1024) per thread when "
               "TORCH_CUBLASLT_UNIFIED_WORKSPACE=0", "allocated",
               f"{_LOG}/facts2.log:4 ('bf16 matmul: extra allocated MiB 0.0'), :6 ('autocast linear: "
               f"allocated delta MiB 2.25': the bf16 copies); {_TORCH_BLAS} getCUDABlasLtWorkspaceSize",
               "added per thread that runs addmm / _scaled_mm when not unified"),
    CudaFigure("cuDNN RNN reserve space", "steps x batch x hidden x element x layers x directions x "
               "(LSTM 5.5, GRU 4.25, RNN 2.0 assumed)", "allocated",
               f"{_LOG}/facts2.log:9 (LSTM 2x512 b32 t128 fp32: 96.25 MiB after forward = 8 output + "
               "0.25 states + 88 reserve), :10 (GRU: 76.06 = 8 + 0.125 + 67.94)",
               "the size of _cudnn_rnn's reserve output (the fake kernel returns 0 bytes), alive until "
               "the backward"),
    CudaFigure("cuDNN RNN backward workspace", "steps x batch x hidden x element x layers x directions x "
               "(LSTM 4.1, GRU 4.7, RNN 2.0 assumed), + a contiguous copy of a non-contiguous "
               "grad_output", "allocated",
               f"{_LOG}/facts2.log:9 (LSTM peak 194.03 MiB: 97.78 over the forward = 8 grad_output + "
               "8 dx + 16.03 dw + 0.25 dh + 65.5), :10 (GRU peak 179.38: 103.31 = 8 + 8 + 12.02 + "
               "0.125 + 75.2)",
               "transient at the backward op (in the peak if that is the peak's moment)"),
    CudaFigure("cuDNN convolution workspaces", "not sized: cuDNN's heuristics pick the algorithm "
               "(up to 132 MiB beyond the tensors seen for 8 MiB activations)", "allocated",
               f"{_LOG}/facts2.log:8 ('conv fwd+bwd: peak over base MiB 152.78 (out 49.0)'); "
               f"{_LOG}/pytest-gpu.log:204 (resnet batch 64: 132 MiB beyond cuBLAS's), :123 "
               "(cnn-batchnorm batch 64: none)",
               "not in the peak; 256 MiB at the high end of nvidia-smi's range (assumed)"),
    CudaFigure("CUDA context", "518 MiB after torch.cuda.init(); 812-834 MiB beyond "
               "max_memory_reserved once cuBLAS and cuDNN have loaded", "nvidia-smi",
               f"{_LOG}/facts2.log:2 ('empty context: smi (mine, device) MiB [518.0, ...]'), :11 "
               f"(1438 - 610 = 828); {_LOG}/pytest-gpu.log:14-211 (nvidia-smi - reserved: 812-834)",
               "low / expected / high of what nvidia-smi shows"),
    CudaFigure("caching allocator", "512 B blocks; blocks up to 1 MiB from 2 MiB segments, 1-10 MiB "
               "from 20 MiB segments, larger rounded to 2 MiB; reserved - allocated at the peak: "
               "4-75 MiB (x1.10-x1.51) in the log", "nvidia-smi",
               "torch c10/cuda/CUDACachingAllocator.cpp (kMinBlockSize, kSmallBuffer, kLargeBuffer, "
               f"kRoundLarge); {_LOG}/pytest-gpu.log:14-211 (reserved vs allocated)",
               "512 B rounding of every tensor in the peak; the rest in nvidia-smi's range"),
)

#: aten ops that take a cuBLAS handle (and so its workspace) on CUDA
BLAS_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::mv",
    "aten::addmv", "aten::dot", "aten::vdot", "aten::matmul", "aten::_addmm_activation",
    "aten::_scaled_mm", "aten::_int_mm", "aten::_grouped_mm", "aten::_scaled_grouped_mm",
})
#: the ones that may run through cuBLASLt (a bias epilogue, scaled matmuls)
LT_OPS = frozenset({"aten::addmm", "aten::_addmm_activation", "aten::_scaled_mm"})


def cublas_workspace_bytes(major: int | None, env: Mapping[str, str] | None = None) -> int:
    """Bytes of one cuBLAS workspace: ``CUBLAS_WORKSPACE_CONFIG`` (":SIZE_KIB:COUNT" pairs,
    summed) when set, else torch's default for compute capability ``major`` (None: the newest)."""
    config = (os.environ if env is None else env).get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * _KIB * int(count) for size, count in pairs)
    return CUBLAS_DEFAULT if major is None or 9 <= major <= 12 else CUBLAS_DEFAULT_OLDER


def cublaslt_extra_bytes(env: Mapping[str, str] | None = None) -> int:
    """Bytes cuBLASLt adds per thread beyond cuBLAS's workspace: 0 when the two are unified
    (the default), else ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024)."""
    env = os.environ if env is None else env
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1").strip().lower() not in ("0", "false", "off", "no"):
        return 0
    size = env.get("CUBLASLT_WORKSPACE_SIZE", "")
    return int(size) * _KIB if size.strip().isdigit() else CUBLASLT_DEFAULT


class BlasWorkspaces:
    """The cuBLAS (and cuBLASLt) workspaces a step leaves allocated, from the ops it runs.

    torch keeps one workspace per (cuBLAS handle, stream) for good; each thread has its own
    handle, and CUDA's backward runs on autograd's own thread: a step whose forward and backward
    both multiply matrices holds two. The default stream is assumed.
    """

    def __init__(self, cublas: int, cublaslt_extra: int = 0) -> None:
        self.cublas = cublas
        self.cublaslt_extra = cublaslt_extra
        self.seen: set[tuple[str, str]] = set()

    def added(self, op: str, *, backward: bool) -> int:
        """Bytes ``op`` allocates for good the first time it runs on its thread (0 after)."""
        thread = "autograd" if backward else "caller"
        added = 0
        if op in BLAS_OPS and (thread, "cublas") not in self.seen:
            self.seen.add((thread, "cublas"))
            added += self.cublas
        if self.cublaslt_extra and op in LT_OPS and (thread, "cublaslt") not in self.seen:
            self.seen.add((thread, "cublaslt"))
            added += self.cublaslt_extra
        return added

    @property
    def total(self) -> int:
        """Bytes held by every workspace so far."""
        return sum(self.cublas if kind == "cublas" else self.cublaslt_extra for _, kind in self.seen)


def blas_workspaces_here() -> BlasWorkspaces:
    """The workspaces of this process's GPU: torch's own figure where it tells it (2.12+), else
    the environment and the compute capability (none: the newest GPUs' default)."""
    import torch

    major = None
    cublas = None
    if torch.cuda.is_available():
        major = torch.cuda.get_device_capability()[0]
        ask = getattr(torch.backends.cuda, "cublas_workspace_size", None)
        try:
            cublas = int(ask()) if callable(ask) else None
        except (RuntimeError, TypeError):
            cublas = None
    if cublas is None:
        cublas = cublas_workspace_bytes(major)
    return BlasWorkspaces(cublas, cublaslt_extra_bytes())


def _rnn_unit(steps: int, batch: int, hidden: int, layers: int, directions: int, element_size: int) -> int:
    return steps * batch * hidden * layers * directions * element_size


def cudnn_rnn_reserve_bytes(steps: int, batch: int, hidden: int, layers: int, directions: int,
                            mode: int, element_size: int) -> int:
    """Bytes of cuDNN's RNN reserve space (``mode``: cudnnRNNMode_t, 2 LSTM, 3 GRU), as measured."""
    factor = _RNN_RESERVE[_CUDNN_MODES.get(int(mode), "lstm")]
    return int(_rnn_unit(steps, batch, hidden, layers, directions, element_size) * factor)


def cudnn_rnn_workspace_bytes(steps: int, batch: int, hidden: int, layers: int, directions: int,
                              mode: int, element_size: int) -> int:
    """Bytes cuDNN's RNN backward allocates for the op's duration beyond its outputs, as measured."""
    factor = _RNN_BACKWARD_WORKSPACE[_CUDNN_MODES.get(int(mode), "lstm")]
    return int(_rnn_unit(steps, batch, hidden, layers, directions, element_size) * factor)
