"""Rank environments read from torchrun, Slurm, MPI, dk.launch and plain-process variables."""

from __future__ import annotations

import pytest

from devicekit.errors import DistributedError
from devicekit.hardware.launchers import detect_environment, expand_nodelist
from devicekit.hardware.launchers.slurm import port_for_job, tasks_per_node
from devicekit.parallel import dist


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
    "SLURM_JOB_ID": "123456", "SLURM_JOB_NAME": "train.sh", "SLURM_STEP_ID": "0",
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


def test_the_job_name_does_not_decide_a_step_task_is_a_rank() -> None:
    # srun steps inside salloc inherit its job name "interactive": they are still ranks
    for name in ("bash", "interactive", "sh", "zsh"):
        assert read({**SLURM, "SLURM_JOB_NAME": name}).source == "slurm"
    # salloc's own shell: no SLURM_PROCID, no step id
    shell = {k: v for k, v in SLURM.items() if k not in ("SLURM_PROCID", "SLURM_STEP_ID", "SLURM_LOCALID")}
    assert read(shell).source == "single"


def test_task_variables_without_a_step_are_refused_not_a_world_of_one() -> None:
    no_step = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    with pytest.raises(DistributedError, match="SLURM_PROCID=6 but no SLURM_STEP_ID"):
        read(no_step)


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
        ({"RANK": "4", "WORLD_SIZE": "2"}, "RANK=4 is not in 0..1 (WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"}, "99999"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
          "SLURM_TASKS_PER_NODE": "2(y3)"}, "2(y3)"),
    ],
)
def test_bad_variables_are_one_line_errors(env: dict[str, str], needle: str) -> None:
    with pytest.raises(DistributedError) as info:
        read(env)
    assert needle in str(info.value) and "\n" not in str(info.value)


# -- ported from Lightning's environment tests (tests_fabric/plugins/environments): the same
# -- variable sets, read through devicekit's detect_environment


def test_lightning_kubeflow_variables_are_one_process_per_pod() -> None:
    # Lightning's test_kubeflow.py::test_attributes_from_environment_variables
    facts = read({"KUBERNETES_PORT": "tcp://127.0.0.1:443", "MASTER_ADDR": "1.2.3.4",
                  "MASTER_PORT": "500", "WORLD_SIZE": "20", "RANK": "1"})
    assert facts.source == "kubeflow"
    assert (facts.master_addr, facts.master_port, facts.world_size, facts.rank) == (
        "1.2.3.4", 500, 20, 1)
    # was local_rank=1 of 20 on node 0; Lightning (and the pod) say local 0 of a node of its own
    assert (facts.local_rank, facts.local_world_size, facts.node_rank, facts.nnodes) == (0, 1, 1, 20)


def test_rank_and_world_size_alone_mean_one_process_per_node() -> None:
    facts = read({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "head", "MASTER_PORT": "29400"})
    assert (facts.local_rank, facts.local_world_size, facts.node_rank, facts.nnodes) == (0, 1, 3, 4)


def test_kubeflow_rank_gets_its_pods_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # dk.dist.device() used to refuse: "local rank 1 has no GPU of its own"
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    facts = read({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "MASTER_ADDR": "job-master-0",
                  "MASTER_PORT": "23456", "WORLD_SIZE": "20", "RANK": "1"})
    assert dist.device(facts) == torch.device("cuda", 0)


@pytest.mark.parametrize("env,expected", [
    # Lightning's test_torchelastic.py::test_attributes_from_environment_variables
    ({"MASTER_ADDR": "1.2.3.4", "MASTER_PORT": "500", "LOCAL_WORLD_SIZE": "2",
      "WORLD_SIZE": "20", "RANK": "1", "LOCAL_RANK": "2", "GROUP_RANK": "3",
      "TORCHELASTIC_RUN_ID": "1"}, None),
    ({"MASTER_ADDR": "1.2.3.4", "MASTER_PORT": "500", "LOCAL_WORLD_SIZE": "4",
      "WORLD_SIZE": "20", "RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "3",
      "TORCHELASTIC_RUN_ID": "1"}, ("torchrun", "1.2.3.4", 500, 20, 1, 1, 3)),
])
def test_lightning_torchelastic_variables(env, expected) -> None:
    if expected is None:  # local rank 2 of a node of 2: Lightning reads it, devicekit refuses
        with pytest.raises(DistributedError, match=r"LOCAL_RANK=2 is not below the 2 process\(es\)"):
            read(env)
        return
    facts = read(env)
    assert (facts.source, facts.master_addr, facts.master_port, facts.world_size, facts.rank,
            facts.local_rank, facts.node_rank) == expected


def test_lightning_slurm_variables() -> None:
    # Lightning's test_slurm.py::test_attributes_from_environment_variables, plus the step id
    # every real srun task has (Lightning reads the task variables without one; devicekit
    # refuses them then: see test_task_variables_without_a_step_are_refused_not_a_world_of_one)
    env = {"SLURM_NODELIST": "1.1.1.1, 1.1.1.2", "SLURM_JOB_ID": "0001234", "SLURM_NTASKS": "20",
           "SLURM_NTASKS_PER_NODE": "10", "SLURM_LOCALID": "2", "SLURM_PROCID": "1",
           "SLURM_NODEID": "3", "SLURM_JOB_NAME": "JOB", "SLURM_STEP_ID": "0"}
    facts = read(env)
    assert facts.source == "slurm"
    assert (facts.world_size, facts.rank, facts.local_rank, facts.node_rank) == (20, 1, 2, 3)
    assert facts.local_world_size == 10


@pytest.mark.parametrize("hosts,node_ranks", [
    (["host1", "host2"], [0, 1]),  # Lightning's test_mpi.py::test_init_local_comm
    (["b", "a", "b", "a"], [1, 0, 1, 0]),  # mpirun --map-by node
])
def test_mpi_node_ranks_come_from_host_names(monkeypatch, hosts, node_ranks) -> None:
    import sys
    from unittest import mock

    from devicekit.hardware.launchers import mpi

    fake = mock.MagicMock()
    fake.COMM_WORLD.allgather.return_value = hosts
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake)
    mpi.gather_hostnames.cache_clear()
    try:
        got = []
        for rank in range(len(hosts)):
            mpi.gather_hostnames.cache_clear()
            local = sum(h == hosts[rank] for h in hosts[:rank])
            facts = read({"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(len(hosts)),
                          "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
                          "OMPI_COMM_WORLD_LOCAL_SIZE": str(hosts.count(hosts[rank]))})
            got.append(facts.node_rank)
            assert facts.nnodes == len(set(hosts))
    finally:
        mpi.gather_hostnames.cache_clear()
    assert got == node_ranks


def test_mpi_map_by_node_without_mpi4py_reads_the_placement() -> None:
    # mpirun -np 4 --map-by node over 2 nodes: ranks 0,2 on node 0 and 1,3 on node 1
    def node(rank: int, local: int) -> int:
        return read({"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "4",
                     "OMPI_COMM_WORLD_LOCAL_RANK": str(local),
                     "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}).node_rank

    assert [node(0, 0), node(1, 0), node(2, 1), node(3, 1)] == [0, 1, 0, 1]
    assert [node(0, 0), node(1, 1), node(2, 0), node(3, 1)] == [0, 0, 1, 1]  # --map-by slot


def test_mpi_placement_that_variables_cannot_explain_is_refused() -> None:
    with pytest.raises(DistributedError, match="install mpi4py"):
        read({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "6",
              "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"})


def test_unresolvable_master_address_is_one_line_before_any_rendezvous(monkeypatch) -> None:
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "no-such-node.invalid", "MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(DistributedError, match="'no-such-node.invalid' does not resolve") as info:
        dist.init(timeout=5)
    assert "\n" not in str(info.value)


def test_ip_addresses_and_known_names_resolve() -> None:
    from devicekit.hardware.launchers.base import check_resolvable

    for ok in ("10.1.2.3", "[::1]", "localhost"):
        check_resolvable(ok)
