"""``devicekit run`` under srun, mpirun, torchrun and a Kubeflow pod: it joins their job.

Each environment set is what that launcher gives one task. On today's code before this fix,
every one of them ran as "rank 0 of 1, master 127.0.0.1" without a word (issue 14, item 1).
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from devicekit.errors import DeviceKitError
from devicekit.hardware.launchers import detect_environment
from devicekit.hardware.launchers.slurm import port_for_job
from devicekit.jobs.outer import detect_outer
from devicekit.jobs.run import RunPlan, RunRequest, plan_run
from tests.conftest import h100

HOST = socket.gethostname()  # resolvable here, and not loopback: a "real" node name
PORT = port_for_job("4242")


def srun(procid: int, ntasks: int, localid: int, nodeid: int, nnodes: int, per_node: int,
         **extra: str) -> dict[str, str]:
    """What srun gives one task (SLURM_STEP_ID: a job step, not the batch script)."""
    return {"PATH": "/usr/bin", "SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks),
            "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid),
            "SLURM_NNODES": str(nnodes), "SLURM_JOB_NODELIST": f"{HOST},{HOST}-b",
            "SLURM_TASKS_PER_NODE": f"{per_node}(x{nnodes})", "SLURM_JOB_ID": "4242",
            "SLURM_STEP_ID": "0", "SLURM_JOB_NAME": "train", **extra}


#: torchrun's second rank of two on one node
TORCHRUN = {"PATH": "/usr/bin", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "TORCHELASTIC_RUN_ID": "none"}
#: a PyTorchJob pod: one process per pod, pod index 1 of 2
POD = {"PATH": "/usr/bin", "KUBERNETES_SERVICE_HOST": "10.96.0.1", "RANK": "1", "WORLD_SIZE": "2",
       "MASTER_ADDR": HOST, "MASTER_PORT": "23456"}
#: a PyTorchJob pod meant to run torchrun (the training operator's PET_* variables)
PET_POD = {**POD, "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": HOST, "PET_MASTER_PORT": "23456", "WORLD_SIZE": "4"}
#: mpirun -np 4 --npernode 2: rank 2 is the first rank of the second node
MPIRUN = {"PATH": "/usr/bin", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
          "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


def plan(environ: dict[str, str], **flags: object) -> RunPlan:
    result = plan_run(RunRequest(command=["python", "train.py"], **flags), environ=environ)  # type: ignore[arg-type]
    result.allocation.release()
    return result


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def torchrun_args(argv: list[str]) -> object:
    """The argv as torchrun's own parser reads it (no PET_* defaults from this process)."""
    from torch.distributed.run import parse_args

    start = argv.index("devicekit.jobs.torchrun_entry") + 1
    return parse_args(argv[start:])


def child_facts(result: RunPlan) -> tuple[str, int, int, int, int, str, int]:
    f = detect_environment(result.env).read()
    return f.source, f.rank, f.world_size, f.local_rank, f.node_rank, f.master_addr, f.master_port


# ----------------------------------------------------------------------------- srun


def test_srun_one_task_per_gpu_runs_the_command_as_that_rank() -> None:
    result = plan(srun(3, 8, 3, 0, 2, 4))
    assert not result.distributed and result.argv == ["python", "train.py"]
    env = result.env
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("3", "3", "8", "4")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (HOST, str(PORT))
    # dk.dist.env() in the command still reads Slurm (its GPU binding rules), as rank 3 of 8
    assert child_facts(result) == ("slurm", 3, 8, 3, 0, HOST, PORT)
    assert any("srun (Slurm): rank 3 of 8" in note for note in result.notes)


def test_srun_one_task_per_node_starts_torchrun_with_slurms_world() -> None:
    result = plan(srun(1, 2, 0, 1, 2, 1), procs=4)
    assert result.distributed
    args = torchrun_args(result.argv)
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "4")
    assert (args.master_addr, args.master_port, args.standalone) == (HOST, PORT, False)


def test_srun_flags_that_agree_are_accepted_and_others_refused() -> None:
    env = srun(1, 2, 0, 1, 2, 1)
    assert option(plan(env, procs=2, nnodes="2", node_rank=1).argv, "--nnodes") == "2"
    with pytest.raises(DeviceKitError, match=r"--nnodes 1 but srun \(Slurm\) says '2' \(SLURM_NNODES\)"):
        plan(env, nnodes="1")
    with pytest.raises(DeviceKitError, match="--master-addr elsewhere but srun"):
        plan(env, procs=2, master_addr="elsewhere")


def test_srun_several_tasks_per_node_asking_for_several_processes_is_refused() -> None:
    with pytest.raises(DeviceKitError, match="started 4 tasks on this node.*--ntasks-per-node=1"):
        plan(srun(3, 8, 3, 0, 2, 4), gpus=4)


def test_srun_task_refuses_torchrun_only_options() -> None:
    with pytest.raises(DeviceKitError, match="--max-restarts is a torchrun option.*ntasks-per-node=1"):
        plan(srun(3, 8, 3, 0, 2, 4), max_restarts=2)


def test_sbatch_script_itself_is_not_a_task() -> None:
    batch = {k: v for k, v in srun(0, 8, 0, 0, 2, 4).items() if k != "SLURM_STEP_ID"}
    with pytest.raises(DeviceKitError, match="batch script of a Slurm job on 2 nodes.*srun"):
        plan(batch)
    one_node = {**batch, "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "8"}
    assert detect_outer(one_node) is None  # one node: a plain machine (today's behaviour)
    assert plan(one_node).env["WORLD_SIZE"] == "1"


# ----------------------------------------------------------------------------- torchrun


def test_under_torchrun_each_rank_runs_as_itself() -> None:
    result = plan(TORCHRUN)
    assert not result.distributed
    assert child_facts(result) == ("torchrun", 1, 2, 1, 0, "127.0.0.1", 29511)


def test_under_torchrun_a_nested_torchrun_is_refused() -> None:
    with pytest.raises(DeviceKitError, match="already a rank of torchrun.*--nproc-per-node"):
        plan(TORCHRUN, procs=2)


# ----------------------------------------------------------------------------- Kubernetes


def test_pytorchjob_pod_runs_as_the_pods_rank() -> None:
    result = plan(POD)
    assert not result.distributed
    _, rank, world, local, node, addr, port = child_facts(result)
    assert (rank, world, local, node, addr, port) == (1, 2, 0, 1, HOST, 23456)


def test_pytorchjob_pod_asking_for_processes_runs_torchrun_per_pod() -> None:
    args = torchrun_args(plan(POD, procs=2).argv)
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "2")
    assert (args.master_addr, args.master_port) == (HOST, 23456)


def test_pet_variables_give_torchrun_its_world_and_nnodes_cannot_override_them() -> None:
    result = plan(PET_POD)
    args = torchrun_args(result.argv)
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", 1, "2")
    assert (args.master_addr, args.master_port) == (HOST, 23456)
    with pytest.raises(DeviceKitError, match="--nnodes 1 but .*'2' \\(PET_NNODES\\)"):
        plan(PET_POD, nnodes="1")
    with pytest.raises(DeviceKitError, match="PET_NPROC_PER_NODE=2"):
        plan(PET_POD, procs=3)


def test_elastic_pet_pod_passes_the_rendezvous() -> None:
    elastic = {"PATH": "/usr/bin", "PET_NNODES": "1:4", "PET_RDZV_BACKEND": "c10d",
               "PET_RDZV_ENDPOINT": f"{HOST}:29400", "PET_RDZV_ID": "job-7", "PET_NPROC_PER_NODE": "1"}
    args = torchrun_args(plan(elastic).argv)
    assert (args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == (
        "1:4", "c10d", f"{HOST}:29400", "job-7")


# ----------------------------------------------------------------------------- mpirun


def test_mpirun_rank_runs_as_itself_with_master_addr_exported() -> None:
    result = plan({**MPIRUN, "MASTER_ADDR": HOST})
    assert not result.distributed
    assert child_facts(result)[:5] == ("mpi", 2, 4, 0, 1)


def test_mpirun_over_nodes_without_master_addr_is_refused() -> None:
    with pytest.raises(DeviceKitError, match="defaults to 127.0.0.1; export MASTER_ADDR.*mpirun -x"):
        plan(MPIRUN)


# ----------------------------------------------------------------------------- GPUs per task

UUIDS = [f"GPU-0000000{i}-1111-2222-3333-444444444444" for i in range(2)]


def test_each_srun_task_leases_its_own_gpu(simulate: Callable[..., Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    simulate([h100(uuid=UUIDS[0]), h100(uuid=UUIDS[1])])
    first = plan_run(RunRequest(command=["train"]), environ=srun(0, 2, 0, 0, 1, 2))
    try:
        second = plan_run(RunRequest(command=["train"]), environ=srun(1, 2, 1, 0, 1, 2))
        try:
            seen = {first.env["CUDA_VISIBLE_DEVICES"], second.env["CUDA_VISIBLE_DEVICES"]}
            assert seen == set(UUIDS)  # one GPU each, never the same one
            assert first.env["DEVICEKIT_OWN_DEVICES"] == second.env["DEVICEKIT_OWN_DEVICES"] == "1"
            assert (first.env["RANK"], second.env["RANK"]) == ("0", "1")
        finally:
            second.allocation.release()
    finally:
        first.allocation.release()


def test_dry_run_prints_what_would_start_under_srun(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from devicekit.cli.main import main

    for key, value in srun(5, 8, 1, 1, 2, 4).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as done:
        main(["run", "--dry-run", "--", sys.executable, "-c", "pass"])
    out, err = capsys.readouterr()
    assert done.value.code == 0, err
    lines = out.splitlines()
    assert lines[-1] == f"{sys.executable} -c pass"
    assert {"RANK=5", "WORLD_SIZE=8", "LOCAL_RANK=1", "GROUP_RANK=1"} <= set(lines[:-1])
    assert "nothing started" in err
