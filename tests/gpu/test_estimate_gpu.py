"""On a real GPU: dk.estimate_memory over the zoo vs max_memory_allocated / reserved / nvidia-smi;
dk.shard trains on one GPU.

Run: python -m pytest -q -m gpu tests/gpu/test_estimate_gpu.py
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch

import devicekit as dk
from tests.memory.estimate_models import measured_peak_cuda
from tests.memory.zoo import ZOO

pytestmark = pytest.mark.gpu

#: the issue's goal: within 10 % of the allocator's peak, never under it by more than 5 %
TOLERANCE, UNDER = 0.10, 0.05


def _fresh() -> int:
    """Start a case as a fresh process would: no cuBLAS workspace yet (earlier tests leave theirs,
    and they count in max_memory_allocated), nothing cached; returns what earlier tests still hold."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _smi_bytes() -> int:
    """This process's memory as nvidia-smi shows it (NVML's per-process figure)."""
    import pynvml

    pynvml.nvmlInit()
    index = torch.cuda.current_device()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    return max((p.usedGpuMemory or 0) for p in procs if p.pid == os.getpid())


@pytest.mark.parametrize("name", sorted(n for n, c in ZOO.items() if n != "moe-routed"))
@pytest.mark.parametrize("batch", [8, 64])
def test_zoo_vs_allocated_reserved_and_nvidia_smi(name: str, batch: int) -> None:
    case = ZOO[name]
    torch.manual_seed(0)
    before = _fresh()
    model = case.build().cuda()
    sample = case.sample(batch, "cuda")
    est = dk.estimate_memory(model, sample, loss_fn=case.loss, precision=case.precision, device="cuda")
    allocated, reserved = measured_peak_cuda(model, sample, precision=case.precision, loss_fn=case.loss)
    allocated -= before
    smi = _smi_bytes()
    ratio = est.peak / allocated
    print(f"{name} batch {batch}: estimate {est.peak} allocated {allocated} ratio {ratio:.3f}; "
          f"reserved {reserved} nvidia-smi {smi} range {est.low}-{est.high}; parts {est.parts}")
    assert -UNDER <= ratio - 1 <= TOLERANCE, (name, batch, est.peak, allocated)
    assert est.high >= reserved and est.low <= smi <= est.high, (name, batch, est.low, est.high, reserved, smi)


def _allocated_by(fn: Any) -> tuple[int, int]:
    """(bytes ``fn`` leaves allocated, its peak over the start) on the current stream."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    keep = fn()
    torch.cuda.synchronize()
    left, peak = torch.cuda.memory_allocated() - start, torch.cuda.max_memory_allocated() - start
    del keep
    return left, peak


def test_the_cuda_terms_hold_on_this_gpu() -> None:
    """The figures in devicekit.memory.cuda_terms, re-measured: a failure names the one to fix."""
    from devicekit.memory.cuda_terms import blas_workspaces_here, cudnn_rnn_reserve_bytes

    mib = 1 << 20
    _fresh()
    workspace = blas_workspaces_here().cublas
    a = torch.randn(256, 256, device="cuda")
    left, _ = _allocated_by(lambda: a @ a)
    assert left - 256 * 256 * 4 == workspace, ("cuBLAS workspace, caller's thread", left, workspace)
    w = torch.randn(256, 256, device="cuda", requires_grad=True)
    left, _ = _allocated_by(lambda: (a @ w).sum().backward())
    assert left - 256 * 256 * 4 == workspace, ("cuBLAS workspace, autograd's thread", left, workspace)
    lstm = torch.nn.LSTM(512, 512, 2, batch_first=True).cuda()
    x = torch.randn(32, 128, 512, device="cuda")
    left, _ = _allocated_by(lambda: lstm(x))
    reserve = cudnn_rnn_reserve_bytes(128, 32, 512, 2, 1, 2, 4)
    print(f"LSTM forward left {left / mib:.2f} MiB; reserve by the table {reserve / mib:.2f} MiB")
    assert abs(left - 8 * mib - mib // 4 - reserve) <= 0.02 * reserve, ("cuDNN LSTM reserve", left, reserve)
    for channels, size, batch in ((32, 32, 8), (32, 32, 64), (64, 56, 64)):   # data for the conv term
        conv = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False).cuda()
        xc = torch.randn(batch, channels, size, size, device="cuda", requires_grad=True)
        _, peak = _allocated_by(lambda: conv(xc).sum().backward())   # noqa: B023
        tensors = 3 * xc.numel() * 4                                   # out, its grad, the input's grad
        print(f"conv {channels}ch {size}px batch {batch}: peak {peak / mib:.1f} MiB over the input, "
              f"{(peak - tensors) / mib:.1f} MiB beyond the tensors (cuDNN's workspace)")


def test_shard_trains_on_one_gpu() -> None:
    import torch.distributed as tdist

    from tests.parallel.shard_workloads import build

    try:
        model = dk.shard(build(), precision="auto")
        assert next(model.parameters()).device.type == "cuda"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(32, 16, device="cuda")
        losses = []
        for _ in range(20):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0] * 0.5, losses
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()
