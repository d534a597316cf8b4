"""dk.ddp and friends: real 2-rank gloo process groups on the CPU, each bounded in time."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch import nn

import devicekit as dk
from tests.parallel import ddp_workloads as work

TIMEOUT = 60.0


def _has_checkpoint_module() -> bool:
    return importlib.util.find_spec("devicekit.placement.checkpoint") is not None


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Two gloo ranks run every scenario once (DDP start-up costs seconds per process)."""
    path = tmp_path_factory.mktemp("ddp") / "ckpt.pt"
    results = dk.launch(work.all_scenarios, str(path) if _has_checkpoint_module() else None,
                        nprocs=2, devices="cpu", timeout=TIMEOUT)
    for result in results:
        result["checkpoint_path"] = path
    return results


def test_ddp_two_ranks_train_and_agree(ranks: list[dict[str, Any]]) -> None:
    results = [r["train"] for r in ranks]
    for result in results:
        assert result["wrapped"] == "DistributedDataParallel"
        assert result["device_ids"] is None          # CPU: DDP must get device_ids=None
        assert result["device"] == "cpu"
    # each rank built different weights on purpose: DDP broadcast rank 0's at wrap time
    assert torch.equal(results[0]["initial"], results[1]["initial"])
    assert torch.allclose(results[0]["final"], results[1]["final"], atol=1e-6)
    assert not torch.allclose(results[0]["final"], results[0]["initial"])


def test_uneven_inputs_with_join_finish_and_agree(ranks: list[dict[str, Any]]) -> None:
    results = [r["join"] for r in ranks]
    assert [r["batches"] for r in results] == [2, 5]
    # Join broadcasts the final model from the last rank to finish
    assert torch.allclose(results[0]["final"], results[1]["final"], atol=1e-6)


def test_distributed_loader_gives_disjoint_shards_and_reshuffles(
        ranks: list[dict[str, Any]]) -> None:
    shards = [r["sampler"] for r in ranks]
    for epoch in (0, 1):
        together = shards[0][epoch] + shards[1][epoch]
        assert sorted(together) == list(range(12))       # disjoint, complete
        assert len(shards[0][epoch]) == len(shards[1][epoch]) == 6
    assert shards[0][0] != shards[0][1]                   # set_epoch reshuffled


def test_ddp_checkpoint_rank0_writes_every_rank_loads(ranks: list[dict[str, Any]]) -> None:
    pytest.importorskip("devicekit.placement.checkpoint")
    path = ranks[0]["checkpoint_path"]
    results = [r["checkpoint"] for r in ranks]
    assert [r["saves"] for r in results] == [1, 0]
    assert all(r["exists_after_save"] for r in results)   # barrier: complete before returning
    for r in results:
        assert r["extra"] == {"epoch": 3}
        assert torch.equal(r["loaded"], r["saved"])
        assert r["loaded_device"] == r["momentum_device"] == "cpu"
    state = torch.load(path, weights_only=True)
    assert not any(k.startswith("module.") for k in state["model"])
    plain = work.build_net()
    plain.load_state_dict(state["model"])                  # loads into an unwrapped model


def test_ddp_checkpoint_consolidates_zero_redundancy_optimizer(
        ranks: list[dict[str, Any]]) -> None:
    """Each rank's ZeRO shard is saved (rank 0 consolidates) and comes back on load."""
    pytest.importorskip("devicekit.placement.checkpoint")
    path = str(ranks[0]["checkpoint_path"]) + ".zero"
    state = torch.load(path, weights_only=True)
    params = len(list(work.build_net().parameters()))
    assert len(state["optimizer"]["state"]) == params  # every parameter's Adam state, not a shard
    shards = [r["zero"] for r in ranks]
    assert all(len(s["own_shard"]) >= 1 for s in shards)  # the state really was split
    assert sum(len(s["own_shard"]) for s in shards) == params
    for s in shards:
        assert torch.equal(s["loaded_params"], s["saved_params"])
        assert len(s["loaded_shard"]) == len(s["own_shard"])
        for want, got in zip(s["own_shard"], s["loaded_shard"], strict=True):
            torch.testing.assert_close(got, want)


def test_ddp_without_process_group_returns_model_unwrapped() -> None:
    net = work.build_net()
    out = dk.ddp(net, device="cpu")
    assert out is net
    assert dk.unwrap_model(out) is net


def test_ddp_rejects_device_ids_and_non_modules() -> None:
    with pytest.raises(dk.InvalidValueError, match="device_ids"):
        dk.ddp(work.build_net(), device_ids=[0])
    with pytest.raises(dk.InvalidValueError, match="nn.Module"):
        dk.ddp("model")  # type: ignore[arg-type]
    with pytest.raises(dk.InvalidDeviceError, match="gpu:0"):
        dk.ddp(work.build_net(), device="gpu:0")


def test_join_is_a_no_op_for_unwrapped_models() -> None:
    with dk.join(work.build_net()):
        pass


def test_single_process_sampler_covers_everything_and_epochs_reshuffle() -> None:
    dataset = torch.utils.data.TensorDataset(torch.arange(10))
    loader = dk.distributed_loader(dataset, batch_size=4)
    orders = [[int(i) for (b,) in loader for i in b] for _ in dk.epochs(loader, 2)]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(10))
    assert orders[0] != orders[1]
    assert list(dk.epochs(loader, 5, start=3)) == [3, 4]
    with pytest.raises(dk.InvalidValueError, match="sampler"):
        dk.distributed_loader(dataset, 4, sampler=None)
    with pytest.raises(dk.InvalidValueError, match="batch_size"):
        dk.distributed_loader(dataset, 0)


def test_unwrap_model_sees_through_wrappers() -> None:
    net = nn.Linear(2, 2)
    assert dk.unwrap_model(nn.DataParallel(net)) is net
    assert dk.unwrap_model(dk.BalancedDataParallel(net, nn.MSELoss())) is net


def test_save_ddp_checkpoint_rejects_reserved_extra_key(tmp_path) -> None:
    with pytest.raises(dk.InvalidValueError, match="model"):
        dk.save_ddp_checkpoint(nn.Linear(2, 2), None, tmp_path / "c.pt", model=1)


def test_check_equivalence_inside_a_running_job_uses_its_ranks(
        ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["equivalence"]["good"] == (True, 2)
        passed, ratio, diagnosis = r["equivalence"]["summed"]
        assert not passed and ratio == pytest.approx(0.5, rel=1e-4)
        assert diagnosis.startswith("sum vs mean reduction")


@pytest.mark.parametrize(("backend", "local_rank", "count", "current", "want", "own", "per_proc"), [
    ("nccl", "2", 4, 0, "cuda:2", None, None),  # torchrun, every GPU visible, set_device forgotten
    ("nccl", "2", 4, 3, "cuda:3", None, None),  # set_device(3) was called: respected
    ("nccl", "1", 1, 0, "cuda:0", None, None),  # dk.launch / Slurm binding: the rank sees only its GPU
    ("gloo", "1", 4, 0, "cpu", None, None),     # devicekit uses gloo only for CPU ranks
    # dk.launch(gpus_per_proc=2): rank 1 sees its own two GPUs, init bound cuda:0 (not cuda:1)
    ("nccl", "1", 2, 0, "cuda:0", "1", "2"),
    # torchrun with DEVICEKIT_GPUS_PER_PROC=2, every GPU visible: rank 1's first GPU is cuda:2
    ("nccl", "1", 4, 0, "cuda:2", None, "2"),
])
def test_rank_device_follows_the_process_group(monkeypatch: pytest.MonkeyPatch, backend: str,
                                               local_rank: str, count: int, current: int,
                                               want: str, own: str | None,
                                               per_proc: str | None) -> None:
    import torch.distributed as dist

    from devicekit.parallel.ddp import rank_device
    from devicekit.parallel.dist import GPUS_PER_PROC_ENV, OWN_DEVICES_ENV

    for name, value in ((OWN_DEVICES_ENV, own), (GPUS_PER_PROC_ENV, per_proc)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert rank_device() == torch.device(want)
