"""dk.dist in one process (no launcher) and the one-line errors for known mistakes."""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as tdist

import devicekit as dk
from devicekit.errors import DistributedError
from devicekit.parallel import dist

TORCHRUN_2_NODES = {
    "RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_PORT": "29500",
}


@pytest.fixture
def group() -> Iterator[None]:
    """Whatever a test initialises is torn down afterwards."""
    yield
    dist.destroy()


def test_public_name_is_the_module() -> None:
    assert dk.dist is dist


def test_helpers_work_without_init(capsys: pytest.CaptureFixture[str]) -> None:
    assert not dist.is_initialized()
    assert dist.is_main()
    dist.print0("hello from rank 0")
    assert capsys.readouterr().out == "hello from rank 0\n"
    dist.barrier()
    value = torch.tensor([1.0, 3.0])
    mean = dist.all_reduce_mean(value)
    assert torch.equal(mean, value) and mean is not value
    assert dist.all_reduce_mean(2) == 2.0
    assert dist.gather_object({"a": 1}) == [{"a": 1}]
    assert dist.gather_object("x", dst=0) == ["x"]

    @dist.rank_zero_only
    def answer() -> int:
        return 42

    assert answer() == 42


def test_rank_zero_only_skips_other_ranks(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    calls = []
    dist.rank_zero_only(calls.append)("x")
    dist.print0("not printed")
    assert calls == [] and capsys.readouterr().out == ""


def test_init_single_process_is_idempotent(group: None) -> None:
    device = dist.init(timeout=5)
    assert device == torch.device("cpu")
    assert tdist.is_initialized() and tdist.get_world_size() == 1
    assert tdist.get_backend() == "gloo"
    assert dist.init() == device  # second call: same group, no error
    assert dist.all_reduce_mean(torch.tensor([4], dtype=torch.int64)).dtype == torch.float64
    assert dist.gather_object(7) == [7]
    dist.barrier()


def test_loopback_master_with_several_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {**TORCHRUN_2_NODES, "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(DistributedError) as info:
        dist.init(timeout=1)
    message = str(info.value)
    assert "'127.0.0.1'" in message and "2 nodes" in message and "\n" not in message
    assert not dist.is_initialized()


def test_localhost_in_slurm_master_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    # task 0 of an srun step (srun sets SLURM_STEP_ID; without it this is the batch script)
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
           "SLURM_STEP_ID": "0",
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NAME": "job", "MASTER_ADDR": "localhost"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(DistributedError, match="'localhost'"):
        dist.init(timeout=1)


@pytest.mark.parametrize("argv", [["train.py", "--local_rank=0"], ["train.py", "--local-rank", "0"]])
def test_local_rank_argument_that_disagrees(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(DistributedError) as info:
        dist.init(timeout=1)
    assert "LOCAL_RANK=1" in str(info.value) and "\n" not in str(info.value)


def test_local_rank_argument_without_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["train.py", "--local_rank=3"])
    with pytest.raises(DistributedError, match="--local_rank=3"):
        dist.init(timeout=1)


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def set_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def torchrun(local_rank: int, local_world: int) -> dict[str, str]:
    return {"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(local_world),
            "LOCAL_WORLD_SIZE": str(local_world)}


def test_device_follows_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 4)
    set_env(monkeypatch, torchrun(3, 4))
    assert dist.device() == torch.device("cuda", 3)


def test_device_blocks_for_several_gpus_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 4)
    set_env(monkeypatch, {**torchrun(1, 2), "DEVICEKIT_GPUS_PER_PROC": "2"})
    assert dist.device() == torch.device("cuda", 2)


def test_device_own_gpu_from_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 1)
    set_env(monkeypatch, {**torchrun(3, 4), "DEVICEKIT_LAUNCH": "1", "DEVICEKIT_OWN_DEVICES": "1"})
    assert dist.device() == torch.device("cuda", 0)


def test_too_few_gpus_is_an_error_not_a_modulo(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 2)
    set_env(monkeypatch, torchrun(3, 4))
    with pytest.raises(DistributedError) as info:
        dist.device()
    assert "local rank 3" in str(info.value) and "sees 2" in str(info.value)


def test_slurm_tasks_per_node_not_matching_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 4)
    set_env(monkeypatch, {"SLURM_PROCID": "5", "SLURM_LOCALID": "5", "SLURM_NTASKS": "8",
                          "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "8",
                          "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_NAME": "job", "SLURM_STEP_ID": "0"})
    with pytest.raises(DistributedError) as info:
        dist.device()
    message = str(info.value)
    assert "Slurm started 8 tasks" in message and "4 GPU" in message and "\n" not in message


def test_slurm_gpus_per_task_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 1)  # srun --gpus-per-task=1: each task sees only its GPU
    set_env(monkeypatch, {"SLURM_PROCID": "3", "SLURM_LOCALID": "3", "SLURM_NTASKS": "4",
                          "SLURM_TASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "n1",
                          "SLURM_JOB_NAME": "job", "SLURM_STEP_ID": "0"})
    assert dist.device() == torch.device("cuda", 0)


def test_slurm_rank_stays_slurm_after_init_publishes_torchrun_variables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """init() sets RANK, LOCAL_RANK, ... for a Slurm task; env() must still read Slurm (source,
    node, and the --gpus-per-task binding: read as torchrun, 4 tasks on 1 GPU was an error)."""
    from devicekit.hardware.launchers.torchrun import PUBLISHED_MARKER

    fake_gpus(monkeypatch, 1)
    set_env(monkeypatch, {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
                          "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "4(x2)",
                          "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "42",
                          "SLURM_JOB_NAME": "job", "SLURM_STEP_ID": "0"})
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", PUBLISHED_MARKER):
        monkeypatch.setenv(name, "-")  # recorded, so what the test publishes is undone after it
        monkeypatch.delenv(name)
    before = dist.env()
    dist._publish_torchrun_variables(before)
    import os

    assert (os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"]) == ("1", "1")
    assert dist.env() == before and before.source == "slurm"
    assert dist.device() == torch.device("cuda", 0)
    # a launcher started later inside the job sets its own RANK: that one is torchrun's again
    monkeypatch.setenv("RANK", "0")
    assert dist.env().source == "torchrun"


def test_cpu_tensor_in_an_nccl_collective(monkeypatch: pytest.MonkeyPatch, group: None) -> None:
    dist.init()  # a real (one-rank gloo) group; then pretend it is a 2-rank nccl one
    monkeypatch.setattr(tdist, "get_backend", lambda *a, **k: "nccl")
    monkeypatch.setattr(tdist, "get_world_size", lambda *a, **k: 2)
    with pytest.raises(DistributedError) as info:
        dist.all_reduce_mean(torch.ones(2))
    assert "cpu" in str(info.value) and "nccl" in str(info.value) and "\n" not in str(info.value)


def test_nccl_asked_on_cpu(group: None) -> None:
    with pytest.raises(DistributedError, match="'nccl'"):
        dist.init(backend="nccl")
    with pytest.raises(DistributedError, match="'bogus'"):
        dist.init(backend="bogus")


def test_bad_timeout() -> None:
    with pytest.raises(DistributedError, match="-1"):
        dist.init(timeout=-1)


def test_a_process_given_gpus_warns_loudly_when_torch_has_no_cuda(monkeypatch) -> None:
    # devicekit run --gpus all with a CPU-only torch: GPUs leased, training quietly on the CPU
    monkeypatch.setattr(dist, "_warned", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.delenv("DEVICEKIT_SIMULATE")  # real GPUs: the CPU is not what was meant
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5d9b3c1e")
    with pytest.warns(dist.CPUFallbackWarning, match="CPU-only build; install a CUDA build"):
        assert dist.device() == torch.device("cpu")
    monkeypatch.setattr(dist, "_warned", [])
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with pytest.warns(dist.CPUFallbackWarning, match="built for CUDA 12.4.*driver too old"):
        dist.device()


def test_no_warning_where_no_gpu_was_given(monkeypatch, recwarn) -> None:
    monkeypatch.setattr(dist, "_warned", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for visible in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert dist.device() == torch.device("cpu")
    assert not [w for w in recwarn if issubclass(w.category, dist.CPUFallbackWarning)]


def test_run_refuses_to_lease_real_gpus_for_a_cpu_only_torch(simulate, monkeypatch) -> None:
    import importlib

    import devicekit as dk
    from devicekit.errors import LaunchError

    run_module = importlib.import_module("devicekit.jobs.run")  # the module, not jobs.run()
    from devicekit.sharing.doctor_checks import Inventory
    from devicekit.sharing.leases import read_leases
    from tests.conftest import h100

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    simulate([h100(), h100()])
    real = Inventory("nvml", tuple(dk.gpus()), "550.54", "12.4")
    monkeypatch.setattr(run_module, "take_inventory", lambda: real)
    monkeypatch.setattr(run_module, "backend", lambda: types.SimpleNamespace(name="nvml"))
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(LaunchError, match="2 GPU.s. leased but torch cannot use them: .*CPU-only"):
        run_module.plan_run(run_module.RunRequest(gpus="all", command=["python", "-c", "pass"]))
    assert read_leases() == []  # the leases went back at once
