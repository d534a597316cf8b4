"""On a real GPU: scripts written for torchrun run unchanged under ``devicekit run``; launch binds
each rank to its own leased GPU with nccl; the example reports the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import devicekit

pytestmark = pytest.mark.gpu

SRC = str(Path(devicekit.__file__).resolve().parents[1])

TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])      # what torchrun sets
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    value = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(value)
    if dist.get_rank() == 0:
        print("RESULT", dist.get_world_size(), value.item(), torch.cuda.get_device_properties(0).uuid)
    dist.destroy_process_group()
    """
)


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["PYTHONPATH"] = SRC + (os.pathsep + out["PYTHONPATH"] if out.get("PYTHONPATH") else "")
    out.pop("CUDA_VISIBLE_DEVICES", None)
    return out


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "devicekit", "run", *args], env=env(),
                          capture_output=True, text=True, timeout=timeout)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def test_torchrun_script_runs_unchanged_on_one_gpu(tmp_path: Path) -> None:
    script = tmp_path / "train_torchrun.py"
    script.write_text(TORCHRUN_SCRIPT)
    done = run("--gpus", "1", "--", sys.executable, str(script))
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    _, world, value, uuid = line.split(maxsplit=3)
    assert (world, float(value)) == ("1", 1.0)
    leased = next(x for x in done.stderr.splitlines() if "CUDA_VISIBLE_DEVICES=" in x)
    assert leased.split("=", 1)[1].strip().startswith("GPU-")
    assert uuid.replace("-", "")[:8] in leased.replace("-", "")


@pytest.mark.skipif("gpu_count() < 2", reason="needs 2 GPUs")
def test_torchrun_script_on_two_gpus(tmp_path: Path) -> None:
    script = tmp_path / "train_torchrun.py"
    script.write_text(TORCHRUN_SCRIPT)
    done = run("--gpus", "2", "--", sys.executable, str(script))
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    assert line.split()[1:3] == ["2", "3.0"]


def test_example_reports_the_gpu() -> None:
    done = run("--gpus", "1", "--", sys.executable, "-m", "devicekit.examples", "--seconds", "1")
    assert done.returncode == 0, done.stderr
    assert "device: cuda:0" in done.stdout and "peak GPU memory" in done.stdout


def own_device() -> tuple[str, str, str]:
    import torch
    import torch.distributed as dist

    import devicekit as dk

    device = dk.dist.device()
    value = dk.dist.all_reduce_mean(torch.ones(1, device=device))
    return str(device), dist.get_backend(), f"{value.item():.1f}"


def test_launch_binds_each_rank_to_its_gpu() -> None:
    import devicekit as dk

    n = min(gpu_count(), 2)
    results = dk.launch(own_device, nprocs=n, timeout=120)
    assert results == [("cuda:0", "nccl", "1.0")] * n
