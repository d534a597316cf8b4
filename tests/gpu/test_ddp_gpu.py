"""BalancedDataParallel and dk.ddp on real CUDA devices (skip without a GPU).

Written to pass on a 1-GPU machine (device_ids=[0], two gloo ranks sharing cuda:0) and, where
marked, on 2+ GPUs (a real split across devices, one rank per GPU).
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import devicekit as dk

pytestmark = pytest.mark.gpu


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 16, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def _reference(net: nn.Module, x: torch.Tensor, y: torch.Tensor,
               reduction: str) -> tuple[torch.Tensor, list]:
    ref = copy.deepcopy(net).cuda(0)
    loss = nn.functional.cross_entropy(ref(x.cuda(0)), y.cuda(0), reduction=reduction)
    loss.backward()
    return loss.detach(), [p.grad for p in ref.parameters()]


def _check_against_reference(device_ids: list[int], n: int, reduction: str = "mean") -> None:
    x, y = _batch(n)
    net = _net()
    want_loss, want_grads = _reference(net, x, y, reduction)
    model = dk.BalancedDataParallel(net, nn.CrossEntropyLoss(reduction=reduction),
                                    device_ids=device_ids)
    loss = model(x, y)          # CPU batch: scattered onto the devices like DataParallel does
    loss.backward()
    assert loss.device == torch.device("cuda", device_ids[0])
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-4, atol=1e-5)
    for got, want in zip((p.grad for p in net.parameters()), want_grads, strict=True):
        assert got.device == torch.device("cuda", device_ids[0])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_balanced_dp_one_device_matches_single_device_loss_and_grads() -> None:
    _check_against_reference([0], 12)


def test_balanced_dp_defaults_to_every_visible_gpu() -> None:
    model = dk.BalancedDataParallel(_net(), nn.CrossEntropyLoss())
    assert model.device_ids == list(range(torch.cuda.device_count()))
    assert model.output_device == 0
    assert next(model.parameters()).device == torch.device("cuda", 0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_balanced_dp_two_devices_uneven_chunks_match(reduction: str) -> None:
    _check_against_reference([0, 1], 13, reduction)   # chunks of 7 and 6: still exact


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_balanced_dp_outputs_stay_on_their_devices() -> None:
    x, y = _batch(8)
    model = dk.BalancedDataParallel(_net(), nn.CrossEntropyLoss(), device_ids=[0, 1])
    loss, outputs = model(x, y, return_outputs=True)
    assert [o.device.index for o in outputs] == [0, 1]
    assert [o.shape[0] for o in outputs] == [4, 4]
    assert loss.device.index == 0


def test_ddp_without_group_moves_to_current_gpu_unwrapped() -> None:
    net = _net()
    out = dk.ddp(net)
    assert out is net
    assert next(net.parameters()).device == torch.device("cuda", torch.cuda.current_device())


def ddp_on_gpus(checkpoint_path: str | None) -> dict[str, Any]:
    """A rank: DDP on its own GPU (or the shared cuda:0 on a 1-GPU machine) over gloo.

    The rank joins gloo itself (``dk.dist.init`` rightly refuses two ranks on one GPU)."""
    dist.init_process_group("gloo")  # env://: dk.launch set RANK, WORLD_SIZE, MASTER_*
    rank = dist.get_rank()
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    model = dk.ddp(_net(), device=f"cuda:{index}")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batch(8)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x.cuda(index)), y.cuda(index)).backward()
    optimizer.step()
    result: dict[str, Any] = {"device_ids": model.device_ids, "index": index,
                              "params": [p.detach().cpu() for p in model.parameters()]}
    if checkpoint_path is not None:
        dk.save_ddp_checkpoint(model, optimizer, checkpoint_path, step=1)
        fresh = _net()   # on the CPU: load_ddp_checkpoint maps onto this rank's device
        extra = dk.load_ddp_checkpoint(fresh.cuda(index), None, checkpoint_path)
        result["extra"] = extra
        result["loaded_device"] = str(next(fresh.parameters()).device)
    dist.destroy_process_group()
    return result


def test_ddp_device_ids_name_each_rank_gpu(tmp_path) -> None:
    has_checkpoint = importlib.util.find_spec("devicekit.placement.checkpoint") is not None
    path = str(tmp_path / "ckpt.pt") if has_checkpoint else None
    # devices="visible": both ranks see every GPU (nothing leased), so two can share cuda:0
    results = dk.launch(ddp_on_gpus, path, nprocs=2, devices="visible", backend=None,
                        timeout=120)
    for r in results:
        assert r["device_ids"] == [r["index"]]
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        torch.testing.assert_close(a, b)
    if has_checkpoint:
        for r in results:
            assert r["extra"] == {"step": 1}
            assert r["loaded_device"] == f"cuda:{r['index']}"


def test_check_equivalence_balanced_on_gpus() -> None:
    x, y = _batch(12)
    report = dk.check_equivalence(_net, (x, y), nn.CrossEntropyLoss(), parallel="balanced",
                                  rtol=1e-3, atol=1e-5)
    assert report.passed, str(report)
    assert report.world_size == torch.cuda.device_count()
