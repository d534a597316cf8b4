"""The one launcher reader on the variables a real Slurm set, each way it starts processes.

``slurm_environments.json`` was recorded from slurm-wlm 22.05 by
``python -m tests.slurm.record_environments`` (salloc's shell and interactive step, srun steps
inside salloc and sbatch, a ``bash -c`` wrapper, ``--ntasks-per-node`` and uneven counts over
two nodes); tests/slurm/ runs the same cases live.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from devicekit.errors import DeviceKitError
from devicekit.hardware.launcher_checks import check_launcher
from devicekit.hardware.launchers import detect_environment, slurm_place
from devicekit.jobs.outer import detect_outer, refuse_nested_world

CASES = json.loads((Path(__file__).with_name("slurm_environments.json")).read_text())["cases"]

#: case -> per process (kind, rank, world, local rank, local world, node, nodes), as Slurm meant
EXPECTED = {
    "salloc_shell": [("shell", 0, 1, 0, 1, 0, 1)],
    "salloc_interactive_step": [("shell", 0, 1, 0, 1, 0, 1)],
    "sbatch_script": [("batch", 0, 1, 0, 1, 0, 1)],
    "salloc_srun": [("task", r, 2, r, 2, 0, 1) for r in range(2)],
    "salloc_n4_srun_n2": [("task", r, 2, r, 2, 0, 1) for r in range(2)],
    "srun_bash_c": [("task", r, 2, r, 2, 0, 1) for r in range(2)],
    "sbatch_srun": [("task", r, 2, r, 2, 0, 1) for r in range(2)],
    "srun_ntasks_per_node_two_nodes": [("task", r, 4, r % 2, 2, r // 2, 2) for r in range(4)],
    "srun_uneven_two_nodes": [("task", 0, 3, 0, 2, 0, 2), ("task", 1, 3, 1, 2, 0, 2),
                              ("task", 2, 3, 0, 1, 1, 2)],
}


def test_every_recorded_case_is_expected() -> None:
    assert set(CASES) == set(EXPECTED)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_the_world_each_process_reads(case: str) -> None:
    processes = CASES[case]["processes"]
    assert len(processes) == len(EXPECTED[case])
    for env, want in zip(processes, EXPECTED[case], strict=True):
        facts = detect_environment(env).read()
        got = (slurm_place(env).kind, facts.rank, facts.world_size, facts.local_rank,
               facts.local_world_size, facts.node_rank, facts.nnodes)
        assert got == want, (case, env.get("SLURM_PROCID"))
        assert facts.source == ("slurm" if want[0] == "task" else "single")
        if want[0] == "task":  # every task of a step meets at one master
            assert facts.master_addr == env["SLURM_STEP_NODELIST"].split(",")[0]


def test_the_salloc_job_name_interactive_does_not_make_its_steps_a_world_of_one() -> None:
    env = CASES["salloc_srun"]["processes"][1]
    assert env["SLURM_JOB_NAME"] == "interactive"  # what the old job-name rule went by
    assert detect_environment(env).read().world_size == 2


def test_doctor_names_the_job_and_where_this_process_is() -> None:
    task = check_launcher(CASES["sbatch_srun"]["processes"][1])
    assert task.status == "pass" and "slurm: rank 1/2" in task.message
    job = CASES["sbatch_srun"]["processes"][1]["SLURM_JOB_ID"]
    assert f"in Slurm job {job} (srun step 0" in task.message
    shell = check_launcher(CASES["salloc_shell"]["processes"][0])
    assert "salloc's shell" in shell.message and "world of one" in shell.message


def test_devicekit_run_joins_the_step_and_not_the_shell() -> None:
    assert detect_outer(CASES["salloc_shell"]["processes"][0]) is None
    assert detect_outer(CASES["sbatch_script"]["processes"][0]) is None
    outer = detect_outer(CASES["srun_ntasks_per_node_two_nodes"]["processes"][3])
    assert outer is not None and outer.task is not None
    assert (outer.task.rank, outer.node_rank, outer.nnodes) == (3, 1, "2")


def test_dk_launch_refuses_inside_a_step_of_several_tasks() -> None:
    with pytest.raises(DeviceKitError, match=r"dk.launch\(nprocs=2\) runs in srun task 1 of 2"):
        refuse_nested_world("dk.launch(nprocs=2)", CASES["salloc_srun"]["processes"][1])
    for case in ("salloc_shell", "sbatch_script", "salloc_interactive_step"):
        refuse_nested_world("dk.launch(nprocs=2)", CASES[case]["processes"][0])  # one process


def test_dist_init_warns_in_the_shell_of_a_job_with_several_tasks(monkeypatch) -> None:
    from devicekit.parallel import dist

    for case in ("salloc_shell", "sbatch_script"):
        env = CASES[case]["processes"][0]
        for name in list(__import__("os").environ):
            if name.startswith("SLURM_"):
                monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.warns(dist.WorldOfOneWarning, match=r"of Slurm job \d+ \(2 tasks\), which is none of its tasks"):
            dist._warn_outside_slurm_step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name, value in CASES["salloc_srun"]["processes"][0].items():
            monkeypatch.setenv(name, value)
        dist._warn_outside_slurm_step()  # a task: nothing to warn about


def test_devicekit_run_in_salloc_shell_off_the_node_says_so() -> None:
    from devicekit.jobs.request import RunRequest
    from devicekit.jobs.run_world import resolve_world

    shell = resolve_world(RunRequest(procs=1), CASES["salloc_shell"]["processes"][0])
    assert any("which is not one of the job's nodes (dknode)" in note for note in shell.notes)
    task = resolve_world(RunRequest(procs=1), CASES["sbatch_srun"]["processes"][0])
    assert not any("salloc's shell" in note for note in task.notes)


def test_a_heterogeneous_job_step_is_refused_not_read_as_one_component() -> None:
    """The fixture's Slurm could not run ``salloc -n1 : -n2``; its tasks carry SLURM_HET_SIZE
    and per-component counts (SLURM_NTASKS_HET_GROUP_N) that the reader does not combine, so it
    refuses in one line rather than guess a world from one component's variables."""
    task = dict(CASES["salloc_srun"]["processes"][1])
    task.update(SLURM_HET_SIZE="2", SLURM_NTASKS_HET_GROUP_0="1", SLURM_NTASKS_HET_GROUP_1="2")
    with pytest.raises(DeviceKitError, match=r"SLURM_HET_SIZE=2: a heterogeneous Slurm job"):
        detect_environment(task).read()
