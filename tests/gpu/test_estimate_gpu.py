"""On a real GPU: dk.estimate_memory over the zoo vs max_memory_allocated / reserved / nvidia-smi;
dk.shard trains on one GPU.

Run: python -m pytest -q -m gpu tests/gpu/test_estimate_gpu.py
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

import devicekit as dk
from tests.memory.estimate_models import measured_peak_cuda
from tests.memory.zoo import ZOO

pytestmark = pytest.mark.gpu

#: the issue's goal: within 10 % of the allocator's peak, never under it by more than 5 %
TOLERANCE, UNDER = 0.10, 0.05


def _fresh() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


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
    _fresh()
    model = case.build().cuda()
    sample = case.sample(batch, "cuda")
    est = dk.estimate_memory(model, sample, loss_fn=case.loss, precision=case.precision, device="cuda")
    allocated, reserved = measured_peak_cuda(model, sample, precision=case.precision, loss_fn=case.loss)
    smi = _smi_bytes()
    ratio = est.peak / allocated
    print(f"{name} batch {batch}: estimate {est.peak} allocated {allocated} ratio {ratio:.3f}; "
          f"reserved {reserved} nvidia-smi {smi} range {est.low}-{est.high}")
    assert -UNDER <= ratio - 1 <= TOLERANCE, (name, batch, est.peak, allocated)
    assert est.high >= reserved and est.high >= smi, (name, batch, est.high, reserved, smi)


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
