"""What CUDA adds, decided on the CPU: the workspaces from the ops a step runs, their sizes from
torch's rules and the H200 figures, cuDNN's RNN traced without a GPU, nvidia-smi's range.

A CUDA step cannot be traced on a CPU-only torch (the last test shows why), so the CUDA terms
are checked here through the same dispatch mode the estimate uses, on CPU fake tensors; the real
check is tests/gpu/test_estimate_gpu.py.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

from devicekit.memory.cuda_terms import (
    FIGURES,
    BlasWorkspaces,
    cublas_workspace_bytes,
    cublaslt_extra_bytes,
    cudnn_rnn_reserve_bytes,
)
from devicekit.memory.fake_step import CUDA_WORKSPACES, LiveBytes, _fake_model
from devicekit.memory.gpu_overhead import gpu_range

MIB = 1 << 20


def test_cublas_workspace_follows_torch_rules() -> None:
    assert cublas_workspace_bytes(9, env={}) == 32 * MIB                  # Hopper: measured on the H200
    assert cublas_workspace_bytes(10, env={}) == 32 * MIB
    assert cublas_workspace_bytes(8, env={}) == 8 * MIB + 128 * 1024       # ":4096:2:16:8" before sm90
    assert cublas_workspace_bytes(8, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MIB
    assert cublas_workspace_bytes(9, env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    assert cublas_workspace_bytes(9, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}) == 8 * MIB + 128 * 1024
    assert cublas_workspace_bytes(9, env={"CUBLAS_WORKSPACE_CONFIG": "junk"}) == 32 * MIB


def test_cublaslt_adds_nothing_unless_its_workspace_is_its_own() -> None:
    assert cublaslt_extra_bytes(env={}) == 0
    assert cublaslt_extra_bytes(env={"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}) == MIB
    assert cublaslt_extra_bytes(env={"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0",
                                     "CUBLASLT_WORKSPACE_SIZE": "4096"}) == 4 * MIB


def test_workspaces_from_the_ops_seen() -> None:
    blas = BlasWorkspaces(32 * MIB)
    assert blas.added("aten::convolution", backward=False) == 0          # cuDNN: not cuBLAS's
    assert blas.added("aten::mm", backward=False) == 32 * MIB             # first matmul, caller's thread
    assert blas.added("aten::addmm", backward=False) == 0                 # same handle and stream
    assert blas.added("aten::bmm", backward=True) == 32 * MIB             # autograd's thread: its own
    assert blas.added("aten::mm", backward=True) == 0
    assert blas.total == 64 * MIB
    lt = BlasWorkspaces(32 * MIB, cublaslt_extra=MIB)
    assert lt.added("aten::mm", backward=False) == 32 * MIB                # plain gemm: cuBLAS only
    assert lt.added("aten::addmm", backward=False) == MIB                  # bias epilogue: cuBLASLt
    assert lt.total == 33 * MIB


def test_every_figure_says_where_it_came_from() -> None:
    assert len(FIGURES) >= 8
    for figure in FIGURES:
        assert figure.counts_in in ("allocated", "nvidia-smi"), figure
        assert "gpu-runs/2026-11-28-h200" in figure.source or "torch" in figure.source, figure
        assert figure.size and figure.used


def _traced(model: nn.Module, sample: torch.Tensor, backward: bool = True) -> LiveBytes:
    """``model`` run on CPU fake tensors under the estimate's dispatch mode, CUDA terms on."""
    tracker = LiveBytes("cpu", workspaces=BlasWorkspaces(32 * MIB))
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        fake = _fake_model(model, torch.device("cpu"), tracker)
        x = torch.empty_like(sample, device="cpu")
        tracker.track(x, "inputs")
        tracker.phase, tracker.part = "forward", "activations"
        out = fake(x)
        tracker.phase, tracker.part = "backward", "temporaries"
        if backward:
            out.sum().backward()
    return tracker


def test_a_linear_forward_holds_one_workspace_its_backward_another() -> None:
    mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    assert _traced(mlp, torch.empty(4, 64), backward=False).live[CUDA_WORKSPACES] == 32 * MIB
    both = _traced(mlp, torch.empty(4, 64))
    assert both.live[CUDA_WORKSPACES] == 64 * MIB
    assert both.at_peak[CUDA_WORKSPACES] == 64 * MIB and sum(both.at_peak.values()) == both.peak


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():           # the forward's matmul runs, but only in the caller's thread
            self.block(x)
        return checkpoint(self.block, x.requires_grad_(), use_reentrant=False)


def test_no_matmul_no_workspace_and_recomputation_runs_in_the_backward() -> None:
    convs = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
    assert _traced(convs, torch.empty(2, 3, 8, 8)).live[CUDA_WORKSPACES] == 0
    traced = _traced(_Checkpointed(), torch.empty(4, 32))
    assert traced.workspaces is not None and ("autograd", "cublas") in traced.workspaces.seen


class CudnnRNN(nn.Module):
    """``nn.LSTM`` / ``nn.GRU`` as they run on CUDA: one ``aten._cudnn_rnn`` call, weights not
    flattened (as a fake copy's are), so the fake kernel's flat weight buffer is None."""

    def __init__(self, kind: str, size: int = 512, layers: int = 2) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(size, size, layers, batch_first=True)
        self.mode = {"LSTM": 2, "GRU": 3}[kind]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rnn = self.rnn
        hx = x.new_zeros(rnn.num_layers, x.shape[0], rnn.hidden_size)
        cx = x.new_zeros(hx.shape) if self.mode == 2 else None
        out: Any = torch.ops.aten._cudnn_rnn.default(
            x, rnn._flat_weights, 4, None, hx, cx, self.mode, rnn.hidden_size, 0, rnn.num_layers,
            True, 0.0, True, False, [], None)
        return out[0]


#: facts2.log:9-10: (after the forward, peak) over the weights and input, MiB, 2x512, b32, t128
_MEASURED_RNN = {"LSTM": (96.25, 194.03), "GRU": (76.06, 179.38)}


@pytest.mark.parametrize("kind", sorted(_MEASURED_RNN))
def test_cudnn_rnn_traces_and_matches_the_h200(kind: str) -> None:
    """The H200 run failed here ('weight_buf' None in the fake backward); now it is sized."""
    tracker = LiveBytes("cpu", workspaces=BlasWorkspaces(32 * MIB))
    real = CudnnRNN(kind)   # built outside the tracker, as a user's model is: only its copy counts
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        fake = _fake_model(real, torch.device("cpu"), tracker)
        x = torch.empty(32, 128, 512)
        tracker.track(x, "inputs")
        base = sum(tracker.live.values())
        tracker.phase, tracker.part = "forward", "activations"
        out = fake(x)
        after = sum(tracker.live.values()) - base
        tracker.phase, tracker.part = "backward", "temporaries"
        out.sum().backward()
        grads = [p.grad for p in fake.parameters()]
    assert all(g is not None for g in grads)
    forward, peak = _MEASURED_RNN[kind]
    assert after / MIB == pytest.approx(forward, rel=0.01)
    assert (tracker.peak - base) / MIB == pytest.approx(peak, rel=0.01)
    assert tracker.at_peak[CUDA_WORKSPACES] > 0          # cuDNN's backward workspace, at the peak


def test_the_estimator_runs_a_cudnn_rnn_to_the_end() -> None:
    import devicekit as dk

    est = dk.estimate_memory(CudnnRNN("GRU", size=64), torch.empty(4, 16, 64, device="meta"),
                             loss_fn="mse", device="cpu")
    assert est.peak > est.model_state and est.peak_phase == "backward"   # the cuDNN backward ran


def test_reserve_space_is_the_measured_one() -> None:
    assert cudnn_rnn_reserve_bytes(128, 32, 512, 2, 1, 2, 4) == 88 * MIB       # LSTM
    assert cudnn_rnn_reserve_bytes(128, 32, 512, 2, 1, 3, 4) / MIB == pytest.approx(67.94, rel=0.005)


#: pytest-gpu.log:14-211: (allocated, reserved, nvidia-smi) bytes of the zoo on the H200
_LOGGED = [
    (90267648, 125829120, 977272832), (80722944, 109051904, 977272832), (86250496, 121634816, 991952896),
    (81959936, 117440512, 987758592), (91020288, 117440512, 989855744), (100929024, 104857600, 977272832),
    (86123008, 117440512, 989855744), (77139968, 113246208, 985661440), (90611712, 125829120, 998244352),
    (154143232, 232783872, 1105199104), (174597632, 195035136, 1067450368),
    (139637248, 159383552, 1031798784), (191548416, 216006656, 1088421888),
    (101047808, 104857600, 977272832), (309600256, 346030080, 1220542464),
    (117873152, 130023424, 1004535808),
]


@pytest.mark.parametrize("allocated,reserved,smi", _LOGGED)
def test_nvidia_smi_falls_in_the_range_for_any_estimate_within_the_goal(allocated: int, reserved: int,
                                                                         smi: int) -> None:
    for estimate in (int(allocated * 0.95), allocated, int(allocated * 1.10)):
        low, expected, high = gpu_range(estimate, workspaces_counted=True)
        assert low <= smi <= high, (estimate, low, smi, high)
        assert low <= expected <= high
        assert high >= reserved


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")
def test_a_cuda_step_cannot_be_traced_on_a_cpu_only_torch() -> None:
    """Why estimate_memory refuses device='cuda' here: autograd over CUDA fake tensors needs
    CUDA's device guard, and its absence aborts the process (no exception to catch)."""
    code = ("import torch\nfrom torch._subclasses.fake_tensor import FakeTensorMode\n"
            "with FakeTensorMode():\n"
            "    w = torch.empty(4, 4, device='cuda', requires_grad=True)\n"
            "    (w * 2).sum().backward()\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "cuda" in run.stderr.lower()


def test_a_cuda_estimate_with_convolutions_says_what_it_leaves_out() -> None:
    """cuDNN's convolution workspaces are not sized (cuda_terms): the answer says so, in words
    and in its JSON, rather than state a peak the GPU will pass without a word."""
    import dataclasses

    import devicekit as dk

    convs = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(10))
    convs(torch.empty(1, 3, 8, 8))
    cpu = dk.estimate_memory(convs, torch.empty(2, 3, 8, 8))
    assert cpu.convolutions and "cuDNN" not in str(cpu) and cpu.to_dict()["not in the peak"] == []
    low, expected, high = gpu_range(cpu.peak, convolutions=True)
    cuda = dataclasses.replace(cpu, device=torch.device("cuda"), low=low, expected=expected, high=high)
    assert "not in the peak: cuDNN's convolution workspaces" in str(cuda)
    assert "cuDNN" in cuda.to_dict()["not in the peak"][0]
    plain = dataclasses.replace(cuda, convolutions=False)
    assert "not in the peak" not in str(plain) and plain.to_dict()["not in the peak"] == []
