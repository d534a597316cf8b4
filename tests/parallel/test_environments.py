"""Rank environments read from torchrun, Slurm, MPI, dk.launch and plain-process variables."""

from __future__ import annotations

import pytest

from devicekit.errors import DistributedError
from devicekit.parallel import dist
from devicekit.parallel.environments import detect_environment, expand_nodelist
from devicekit.parallel.environments.slurm import port_for_job, tasks_per_node


def read(env: dict[str, str]) -> dist.DistEnv:
    return detect_environment(env).read()


def test_plain_process_is_rank_zero_of_one() -> None:
    facts = dist.env()
    assert (facts.source, facts.rank, facts.world_size, facts.nnodes) == ("single", 0, 1, 1)
    assert facts.is_main and not facts.is_distributed


def test_torchrun_variables() -> None:
    facts = read({
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node01", "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "x",
    })
    assert facts == dist.DistEnv(5, 1, 8, 4, 1, 2, "node01", 29400, "torchrun")


def test_launch_variables_are_marked_devicekit() -> None:
    facts = read({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4000", "DEVICEKIT_LAUNCH": "1"})
    assert facts.source == "devicekit" and facts.rank == 1 and facts.nnodes == 1


def test_torchrun_wins_inside_a_slurm_job() -> None:
    facts = read({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4",
                  "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train"})
    assert facts.source == "torchrun" and facts.rank == 3


SLURM = {
    "SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NTASKS": "8", "SLURM_NODEID": "1",
    "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_ID": "123456", "SLURM_JOB_NAME": "train.sh",
}


def test_slurm_variables() -> None:
    facts = read(SLURM)
    assert facts.source == "slurm"
    assert (facts.rank, facts.local_rank, facts.world_size, facts.local_world_size) == (6, 2, 8, 4)
    assert (facts.node_rank, facts.nnodes) == (1, 2)
    assert facts.master_addr == "gpu07"
    assert facts.master_port == port_for_job("123456") == 15000 + 123456 % 15000


def test_slurm_master_variables_win() -> None:
    facts = read({**SLURM, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "23456"})
    assert (facts.master_addr, facts.master_port) == ("10.0.0.5", 23456)


def test_slurm_uneven_tasks_per_node() -> None:
    facts = read({**SLURM, "SLURM_TASKS_PER_NODE": "3,1", "SLURM_NTASKS": "4", "SLURM_PROCID": "3",
                  "SLURM_LOCALID": "0"})
    assert facts.local_world_size == 1
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def test_interactive_slurm_shell_is_a_plain_process() -> None:
    facts = read({**SLURM, "SLURM_JOB_NAME": "bash"})
    assert facts.source == "single"


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("gpu[8-11],login1", ["gpu8", "gpu9", "gpu10", "gpu11", "login1"]),
        ("a-[1-2]-ib,b[009-010]", ["a-1-ib", "a-2-ib", "b009", "b010"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ],
)
def test_nodelist_expansion(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node01]", "node[a-b]", "node[5-3]"])
def test_bad_nodelist_is_one_line(bad: str) -> None:
    with pytest.raises(DistributedError) as info:
        expand_nodelist(bad)
    assert bad in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "env",
    [
        {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
         "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
        {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"},
        {"MV2_COMM_WORLD_RANK": "5", "MV2_COMM_WORLD_SIZE": "8",
         "MV2_COMM_WORLD_LOCAL_RANK": "1", "MV2_COMM_WORLD_LOCAL_SIZE": "4"},
    ],
    ids=["openmpi", "mpich-pmi", "mvapich"],
)
def test_mpi_flavours(env: dict[str, str]) -> None:
    facts = read({**env, "MASTER_ADDR": "head"})
    assert facts.source == "mpi"
    assert (facts.rank, facts.local_rank, facts.world_size, facts.local_world_size) == (5, 1, 8, 4)
    assert (facts.node_rank, facts.nnodes, facts.master_addr) == (1, 2, "head")


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
        ({"RANK": "4", "WORLD_SIZE": "2"}, "rank 4"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"}, "99999"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2(y3)"}, "2(y3)"),
    ],
)
def test_bad_variables_are_one_line_errors(env: dict[str, str], needle: str) -> None:
    with pytest.raises(DistributedError) as info:
        read(env)
    assert needle in str(info.value) and "\n" not in str(info.value)
