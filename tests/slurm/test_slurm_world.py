"""Every way Slurm starts processes gives the world Slurm meant, against a real slurmctld/slurmd.

salloc + srun, sbatch + srun, ``bash -c`` wrappers, ``--ntasks-per-node`` and uneven counts over
two nodes, ``dk.launch`` inside a step, and a real two-rank process group; the same cases'
variables, recorded, drive the fast tests in tests/hardware/test_slurm_environments.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.slurm.cluster import SlurmCluster

SRC = str(Path(__file__).resolve().parents[2] / "src")
PY = sys.executable
#: one line per process: source rank world local-rank local-world node nodes
SHOW = ("import devicekit as dk; e = dk.dist.env();"
        " print('W', e.source, e.rank, e.world_size, e.local_rank, e.local_world_size,"
        " e.node_rank, e.nnodes)")


def _worlds(stdout: str) -> list[str]:
    return sorted(line[2:] for line in stdout.splitlines() if line.startswith("W "))


@pytest.mark.parametrize("argv", [
    ["salloc", "-n", "2", "srun", "-n", "2", PY, "-c", SHOW],                     # the case
    ["salloc", "-n", "2", "srun", "-n", "2", "bash", "-c", f'{PY} -c "{SHOW}"'],  # a wrapper
    ["salloc", "-n", "4", "srun", "-n", "2", PY, "-c", SHOW],                     # a smaller step
    ["srun", "-N", "1", "--ntasks-per-node=2", PY, "-c", SHOW],
], ids=["salloc-srun", "salloc-srun-bash-c", "salloc-4-srun-2", "ntasks-per-node"])
def test_srun_tasks_are_one_world_of_two(slurm: SlurmCluster, argv: list[str]) -> None:
    out = slurm.run(argv, env={"PYTHONPATH": SRC}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert _worlds(out.stdout) == ["slurm 0 2 0 2 0 1", "slurm 1 2 1 2 0 1"]


def test_the_salloc_shell_itself_is_one_process(slurm: SlurmCluster) -> None:
    out = slurm.run(["salloc", "-n", "2", PY, "-c", SHOW], env={"PYTHONPATH": SRC})
    assert out.returncode == 0, out.stderr
    assert _worlds(out.stdout) == ["single 0 1 0 1 0 1"]


def test_ntasks_per_node_and_uneven_counts_over_two_nodes(slurm_two_nodes: SlurmCluster) -> None:
    even = slurm_two_nodes.run(["srun", "-N", "2", "--ntasks-per-node=2", PY, "-c", SHOW],
                               env={"PYTHONPATH": SRC})
    assert even.returncode == 0, even.stderr
    assert _worlds(even.stdout) == [f"slurm {r} 4 {r % 2} 2 {r // 2} 2" for r in range(4)]
    uneven = slurm_two_nodes.run(["srun", "-N", "2", "-n", "3", PY, "-c", SHOW],
                                 env={"PYTHONPATH": SRC})
    assert uneven.returncode == 0, uneven.stderr
    assert _worlds(uneven.stdout) == ["slurm 0 3 0 2 0 2", "slurm 1 3 1 2 0 2", "slurm 2 3 0 1 1 2"]


def test_two_srun_tasks_in_salloc_reduce_together(slurm: SlurmCluster) -> None:
    # a real gloo process group over the two tasks: each sees the other's rank in the mean
    code = ("import devicekit as dk; dk.dist.init(timeout=60);"
            " print('MEAN', dk.dist.all_reduce_mean(float(dk.dist.env().rank))); dk.dist.destroy()")
    out = slurm.run(["salloc", "-n", "2", "srun", "-n", "2", PY, "-c", code],
                    env={"PYTHONPATH": SRC, "MASTER_ADDR": "127.0.0.1"}, timeout=90)
    assert out.returncode == 0, out.stderr
    assert sorted(line for line in out.stdout.splitlines() if line.startswith("MEAN")) == ["MEAN 0.5"] * 2


def test_the_sbatch_script_warns_that_it_is_a_world_of_one(slurm: SlurmCluster, tmp_path: Path) -> None:
    (tmp_path / "init.py").write_text(
        "import devicekit as dk\ndk.dist.init()\nprint('W', dk.dist.env().world_size)\n")
    (tmp_path / "show.py").write_text(SHOW.replace("; ", "\n") + "\n")
    job = slurm.submit(f"#!/bin/bash\n#SBATCH -n 2\n{PY} init.py\nsrun -n 2 {PY} show.py\n",
                       cwd=tmp_path, env={"PYTHONPATH": SRC})
    assert slurm.wait_for_job(job, timeout=90) == "COMPLETED", slurm.logs()
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert f"WorldOfOneWarning: dk.dist.init() runs in the sbatch script of Slurm job {job} (2" \
           " tasks), which is none of its tasks: a world of one" in log, log
    assert _worlds(log) == ["1", "slurm 0 2 0 2 0 1", "slurm 1 2 1 2 0 1"]


LAUNCH = """\
import devicekit as dk


def rank():
    return dk.dist.env().rank


if __name__ == "__main__":
    print("RANKS", dk.launch(rank, nprocs=2, devices="cpu", backend=None, timeout=60))
"""


def test_dk_launch_refuses_in_a_step_of_two_and_runs_in_a_step_of_one(slurm: SlurmCluster,
                                                                       tmp_path: Path) -> None:
    script = tmp_path / "launch_two.py"
    script.write_text(LAUNCH)
    two = slurm.run(["srun", "-n", "2", PY, str(script)], env={"PYTHONPATH": SRC}, timeout=60)
    assert two.returncode != 0
    assert two.stderr.count("LaunchError: dk.launch(nprocs=2) runs in srun task") == 2, two.stderr
    assert "each of the 2 ranks would start a world of its own" in two.stderr
    one = slurm.run(["srun", "-n", "1", PY, str(script)], env={"PYTHONPATH": SRC}, timeout=90)
    assert one.returncode == 0, one.stderr
    assert "RANKS [0, 1]" in one.stdout


def test_devicekit_run_in_the_salloc_shell_says_it_is_not_on_the_jobs_node(slurm: SlurmCluster) -> None:
    out = slurm.run(["salloc", "-n", "1", PY, "-m", "devicekit", "run", "--dry-run", "--", "true"],
                    env={"PYTHONPATH": SRC}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "this is salloc's shell of Slurm job" in out.stderr
    assert "which is not one of the job's nodes (dknode)" in out.stderr
    inside = slurm.run(["salloc", "-n", "1", "srun", PY, "-m", "devicekit", "run", "--dry-run", "--",
                        "true"], env={"PYTHONPATH": SRC}, timeout=60)
    assert inside.returncode == 0 and "salloc's shell" not in inside.stderr, inside.stderr
