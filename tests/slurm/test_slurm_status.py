"""status, doctor, leases and advise --sbatch inside (and for) a real Slurm job.

Two jobs on disjoint GPUs: each sees its own GPUs and the other's as taken; the doctor names
the job; a lease carries the Slurm job id; the script ``advise --sbatch`` prints is accepted
by the real ``sbatch``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import h100
from tests.slurm.cluster import GPUS, SlurmCluster

SRC = str(Path(__file__).resolve().parents[2] / "src")
PY = sys.executable
ENV = {"PYTHONPATH": SRC}


def _holder(slurm: SlurmCluster, tmp_path: Path) -> str:
    """A job that holds one GPU (the first, gres index 0) until the test ends."""
    job = slurm.submit("#!/bin/bash\n#SBATCH --gres=gpu:1\nsleep 120\n", cwd=tmp_path)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = slurm.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout.strip()
        if state == "RUNNING":
            return job
        time.sleep(0.1)
    raise TimeoutError(f"job {job} not running after 30 s")


def _in_job(slurm: SlurmCluster, gpus: int, command: str) -> tuple[str, str]:
    """Run ``command`` as a one-task job with ``gpus`` GPUs; (its job id, its stdout)."""
    out = slurm.run(["srun", "-n", "1", f"--gres=gpu:{gpus}", "bash", "-c",
                     f"echo JOB $SLURM_JOB_ID; {command}"], env=ENV, timeout=60)
    assert out.returncode == 0, out.stderr
    first, _, rest = out.stdout.partition("\n")
    return first.split()[1], rest


def test_status_in_a_job_shows_its_gpus_and_the_other_jobs_as_taken(
        slurm: SlurmCluster, tmp_path: Path, simulate: Callable[..., Path]) -> None:
    simulate([h100() for _ in range(GPUS)])
    other = _holder(slurm, tmp_path)
    job, out = _in_job(slurm, 2, f"echo CUDA $CUDA_VISIBLE_DEVICES; {PY} -m devicekit status --json")
    cuda, _, document = out.partition("\n")
    assert cuda == "CUDA 1,2"  # disjoint from the holder's GPU 0
    view = json.loads(document)["slurm"]
    assert (view["job_id"], view["node"], view["gpus"]) == (job, "dknode", [1, 2])
    assert view["taken"] == [{"gpu": 0, "job_id": other, "user": "root"}]
    job_one, table = _in_job(slurm, 1, f"{PY} -m devicekit status")
    assert f"GPU 0: taken by Slurm job {other} (root)" in table
    assert f"Slurm job {job_one} (srun step 0): GPU 1 of node dknode" in table


def test_doctor_in_a_job_names_it(slurm: SlurmCluster, tmp_path: Path,
                                  simulate: Callable[..., Path]) -> None:
    simulate([h100() for _ in range(GPUS)])
    other = _holder(slurm, tmp_path)
    job, out = _in_job(slurm, 1, f"{PY} -m devicekit doctor --no-torch --json")
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["slurm"]["status"] == "pass", checks["slurm"]
    assert checks["slurm"]["message"] == (
        f"Slurm job {job} (srun step 0): GPU 1 of node dknode;"
        f" GPU 0: taken by Slurm job {other} (root)")
    assert f"in Slurm job {job} (srun step 0" in checks["launcher"]["message"]


def test_a_lease_carries_the_slurm_job_id(slurm: SlurmCluster, tmp_path: Path,
                                          simulate: Callable[..., Path]) -> None:
    simulate([h100() for _ in range(GPUS)])
    inner = tmp_path / "inner.sh"  # what devicekit run runs while it holds the lease
    inner.write_text(f"echo DKJOB $DEVICEKIT_JOB_ID\n{PY} -m devicekit status --json\n")
    job, out = _in_job(slurm, 1, f"{PY} -m devicekit run --gpus 1 -- bash {inner}")
    first, _, document = out.partition("\n")
    assert first == f"DKJOB {job}", out
    leases = [lease for gpu in json.loads(document)["gpus"] for lease in gpu["leases"]]
    assert [lease["job"] for lease in leases] == [job]


def test_status_outside_slurm_is_unchanged(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch,
                                           simulate: Callable[..., Path]) -> None:
    simulate([h100()])
    monkeypatch.setenv("PATH", "/nonexistent")  # no squeue / scontrol
    for name in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    from devicekit.cli.main import main

    with pytest.raises(SystemExit):
        main(["status", "--json"])
    assert "slurm" not in json.loads(capsys.readouterr().out)


def test_advise_sbatch_prints_a_script_sbatch_accepts(
        slurm: SlurmCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, simulate: Callable[..., Path]) -> None:
    simulate([h100() for _ in range(GPUS)])
    monkeypatch.chdir(Path(__file__).resolve().parents[2] / "docs" / "examples")
    from devicekit.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(["advise", "fit_models:small_mlp", "--input", "1024", "--sbatch", "--time", "0:30:00"])
    script = capsys.readouterr().out
    assert done.value.code in (0, None)
    assert f"#SBATCH --gres=gpu:{GPUS}\n" in script and "#SBATCH --signal=USR1@90\n" in script
    assert "#SBATCH --ntasks-per-node=1\n" in script and "#SBATCH --time=0:30:00\n" in script
    assert script.rstrip().endswith(f"srun devicekit run --gpus {GPUS} -- python train.py")
    path = tmp_path / "job.sh"
    path.write_text(script)
    test = slurm.run(["sbatch", "--test-only", str(path)], cwd=tmp_path)
    assert test.returncode == 0 and "to start at" in test.stderr, test.stderr
