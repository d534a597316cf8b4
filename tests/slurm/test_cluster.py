"""The Slurm fixture itself is real: steps, gres and the batch script look as on a GPU node."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.slurm.cluster import GPUS, SlurmCluster

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_srun_steps_get_their_task_ids_and_the_allocated_gpus(slurm: SlurmCluster) -> None:
    out = slurm.run(["srun", "-n", "2", f"--gres=gpu:{GPUS // 2}", "bash", "-c",
                     "echo $SLURM_PROCID/$SLURM_NTASKS step=$SLURM_STEP_ID gpus=$CUDA_VISIBLE_DEVICES"])
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.split("\n")[:2]) == ["0/2 step=0 gpus=0,1", "1/2 step=0 gpus=0,1"]


def test_a_batch_job_sees_the_dk_world_of_its_srun_step(slurm: SlurmCluster, tmp_path: Path) -> None:
    code = "import devicekit as dk; e = dk.dist.env(); print(e.source, e.rank, e.world_size)"
    job = slurm.submit(f"#!/bin/bash\n#SBATCH -n 2\nsrun -n 2 {sys.executable} -c '{code}'\n",
                       cwd=tmp_path, env={"PYTHONPATH": SRC})
    assert slurm.wait_for_job(job) == "COMPLETED", slurm.logs()
    lines = sorted((tmp_path / f"slurm-{job}.out").read_text().split("\n"))
    assert [line for line in lines if line] == ["slurm 0 2", "slurm 1 2"]
