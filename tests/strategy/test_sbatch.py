"""advise --sbatch: the job script for the recommended strategy (sbatch accepts it: tests/slurm)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import devicekit as dk
from devicekit.errors import InvalidValueError
from devicekit.strategy.sbatch import check_time, sbatch_script
from tests.conftest import h100


def _model() -> tuple[torch.nn.Module, torch.Tensor]:
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)), \
        torch.randn(16, 256)


def test_ddp_over_two_gpus_of_four_cores_each(simulate: Callable[..., Path]) -> None:
    simulate([h100(), h100()])
    script = sbatch_script(dk.advise(*_model(), host_memory="64GiB"), time="2:00:00", cores=8)
    assert script.splitlines() == [
        "#!/bin/bash", "#SBATCH --job-name=ddp-over-2", "#SBATCH --nodes=1",
        "#SBATCH --ntasks-per-node=1", "#SBATCH --gres=gpu:2", "#SBATCH --cpus-per-task=8",
        "#SBATCH --time=2:00:00", "#SBATCH --signal=USR1@90",
        "# devicekit advise: DDP over 2; in train.py: model = dk.ddp(model)",
        "srun devicekit run --gpus 2 -- python train.py"]


def test_no_gpu_gives_a_cpu_job_without_gres(simulate: Callable[..., Path]) -> None:
    simulate([])
    script = sbatch_script(dk.advise(*_model(), host_memory="64GiB"), cores=4)
    assert "--gres" not in script and "#SBATCH --cpus-per-task=4\n" in script
    assert script.rstrip().endswith("srun python train.py")


def test_nothing_fits_is_refused_in_one_line() -> None:
    advice = dk.advise(*_model(), gpus=["1MiB"], host_memory="1MiB")
    with pytest.raises(InvalidValueError, match="no strategy fits these GPUs") as info:
        sbatch_script(advice)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("good", ["90", "30:00", "02:00:00", "1-12", "1-12:00", "1-12:00:00"])
def test_slurm_time_forms(good: str) -> None:
    assert check_time(good) == good


@pytest.mark.parametrize("bad", ["2h", "", "1:2:3:4", "-5", "1-"])
def test_bad_time_limits_name_the_value(bad: str) -> None:
    with pytest.raises(InvalidValueError, match=f"--time {bad!r} is not a Slurm time limit"):
        check_time(bad)
