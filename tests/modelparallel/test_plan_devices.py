"""dk.plan_devices and the balancer on the meta device: budgets, odd ids, offload, refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit.modelparallel.layer_plan import build_plan
from devicekit.modelparallel.layer_profile import sequential_layers
from devicekit.units import parse_size
from tests.conftest import h100

GiB = 2**30


def billion_stack() -> nn.Sequential:
    """~1.07B parameters on the meta device: 16 x Linear(8192, 8192), no memory allocated."""
    with torch.device("meta"):
        return nn.Sequential(*[nn.Sequential(nn.Linear(8192, 8192), nn.GELU()) for _ in range(16)])


META_SAMPLE = torch.empty(32, 8192, device="meta")


def within_budgets(plan: dk.Plan) -> None:
    for part in plan.parts:
        assert part.budget is not None and part.memory <= part.budget, str(plan)


@pytest.mark.parametrize("parts", [2, 4, 8])
def test_balancer_on_a_billion_parameter_meta_stack(parts: int) -> None:
    model = billion_stack()
    assert sum(p.numel() for p in model.parameters()) > 1_000_000_000
    plan = build_plan(sequential_layers(model), [torch.device("meta")] * parts, sample=META_SAMPLE)
    assert plan.counts == [32 // parts] * parts
    assert 1.0 <= plan.max_over_mean <= 1.01
    assert f"largest/mean part = {plan.max_over_mean:.2f}" in str(plan)
    weights = sum(p.numel() * 4 for p in model.parameters())
    # adam: weights + grads + 2 states = 4 x weights, plus saved activations
    assert 4 * weights < plan.total_memory < 4 * weights + GiB


def test_balancer_with_uneven_layers_reports_imbalance() -> None:
    with torch.device("meta"):  # two 32 MiB layers then six 4 MiB ones: no even cut in two
        model = nn.Sequential(nn.Linear(1024, 8192), nn.Linear(8192, 1024), *[nn.Linear(1024, 1024) for _ in range(6)])
    plan = build_plan(sequential_layers(model), [torch.device("meta")] * 2,
                      sample=torch.empty(8, 1024, device="meta"))
    assert plan.counts == [1, 7]
    assert plan.max_over_mean == pytest.approx(
        max(p.memory for p in plan.parts) / (plan.total_memory / 2))


def test_fewest_gpus_then_balanced_within_budgets() -> None:
    model = billion_stack()  # ~16 GiB to train with adam
    plan = dk.plan_devices(model, {0: "10GiB", 1: "10GiB", 2: "10GiB", "cpu": "64GiB"}, sample=META_SAMPLE)
    assert [str(d) for d in plan.devices] == ["cuda:0", "cuda:1"]
    within_budgets(plan)
    assert plan.max_over_mean < 1.05
    assert any("2 of 3 GPU(s) suffice" in r for r in plan.reasons)


def test_spread_uses_every_gpu_for_a_pipeline() -> None:
    budgets = {0: "40GiB", 2: "40GiB", 5: "40GiB", 6: "40GiB"}
    assert len(dk.plan_devices(billion_stack(), budgets, sample=META_SAMPLE).parts) == 1
    plan = dk.plan_devices(billion_stack(), budgets, sample=META_SAMPLE, spread=True)
    assert [str(d) for d in plan.devices] == ["cuda:0", "cuda:2", "cuda:5", "cuda:6"]
    assert plan.counts == [8, 8, 8, 8] and plan.max_over_mean < 1.01
    within_budgets(plan)


def test_non_contiguous_gpu_ids() -> None:
    plan = dk.plan_devices(billion_stack(), {3: "12GiB", 1: "12GiB"}, sample=META_SAMPLE)
    assert [str(d) for d in plan.devices] == ["cuda:1", "cuda:3"]
    within_budgets(plan)
    plan = dk.plan_devices(billion_stack(), {"cuda:3": "40GiB", "cuda:1": "12GiB"}, sample=META_SAMPLE)
    assert [str(d) for d in plan.devices] == ["cuda:3"]  # the roomiest GPU alone holds it


def test_offloads_to_cpu_when_gpus_are_full() -> None:
    plan = dk.plan_devices(billion_stack(), {0: "5GiB", 1: "5GiB", "cpu": "64GiB"}, sample=META_SAMPLE)
    assert [str(d) for d in plan.devices] == ["cuda:0", "cuda:1", "cpu"]
    within_budgets(plan)
    assert plan.parts[-1].layers > 0 and any("run on cpu" in r for r in plan.reasons)
    linear = 8192 * 8192 + 8192
    # a Linear costs 1 GiB to train with adam (4 x 256 MiB): four fit in each 5 GiB GPU, not five
    assert [p.parameters // linear for p in plan.parts] == [4, 4, 8]


def test_refuses_clearly_when_nothing_fits() -> None:
    with pytest.raises(dk.SplitError) as err:
        dk.plan_devices(billion_stack(), {0: "4GiB", "cpu": "2GiB"}, sample=META_SAMPLE)
    message = str(err.value)
    assert "cannot hold it" in message and "cuda:0 4 GiB" in message and "\n" not in message


def test_activations_and_training_are_counted() -> None:
    small = torch.empty(1, 8192, device="meta")
    big = torch.empty(4096, 8192, device="meta")
    budgets = {0: "80GiB"}
    light = dk.plan_devices(billion_stack(), budgets, sample=small)
    heavy = dk.plan_devices(billion_stack(), budgets, sample=big)
    inference = dk.plan_devices(billion_stack(), budgets, sample=big, training=False)
    sgd = dk.plan_devices(billion_stack(), budgets, sample=small, optimizer="sgd")
    assert heavy.total_memory - light.total_memory > 16 * 4095 * 8192 * 4  # saved activations
    assert inference.total_memory < sgd.total_memory < light.total_memory


def test_default_budgets_come_from_the_inventory_with_headroom(simulate, monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    simulate([h100(used="70GiB"), h100(used="2GiB"), h100(used="79GiB"), h100(used="10GiB")])
    plan = dk.plan_devices(billion_stack(), sample=META_SAMPLE)
    assert [str(d) for d in plan.devices] == ["cuda:1"]  # the freest GPU holds it
    part = plan.parts[0]
    assert part.budget == parse_size("78GiB") - parse_size("8GiB")  # free minus 10% of 80 GiB
    assert any("kept as headroom" in r for r in plan.reasons)
    # only GPUs 2 and 3 visible: torch calls them cuda:0 and cuda:1; GPU 2 is nearly full
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    plan = dk.plan_devices(billion_stack(), sample=META_SAMPLE, headroom=0.2)
    assert [str(d) for d in plan.devices] == ["cuda:1"]
    assert plan.parts[0].budget == parse_size("70GiB") - parse_size("16GiB")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible: everything on the CPU
    plan = dk.plan_devices(nn.Sequential(nn.Linear(64, 64), nn.ReLU()), sample=torch.randn(4, 64))
    assert [str(d) for d in plan.devices] == ["cpu"]


def test_devices_filter_and_bad_budgets(simulate, monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    simulate([h100(), h100(), h100()])
    plan = dk.plan_devices(billion_stack(), sample=META_SAMPLE, devices=[2])
    assert [str(d) for d in plan.devices] == ["cuda:2"]
    with pytest.raises(dk.InvalidValueError, match="have no budget"):
        dk.plan_devices(billion_stack(), {0: "10GiB"}, devices=[5])
    with pytest.raises(dk.InvalidSizeError, match="max_memory"):
        dk.plan_devices(billion_stack(), {0: "lots"})
    with pytest.raises(dk.InvalidDeviceError, match="'gpu0'"):
        dk.plan_devices(billion_stack(), {"gpu0": "10GiB"})
    with pytest.raises(dk.InvalidValueError, match="headroom 1.5"):
        dk.plan_devices(billion_stack(), {0: "10GiB"}, headroom=1.5)


def test_plan_feeds_split() -> None:
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    plan = dk.plan_devices(model, {"cpu": "1GiB"}, sample=torch.randn(4, 16))
    split = dk.split(model, plan)
    assert split.devices == [torch.device("cpu")] and split(torch.randn(2, 16)).shape == (2, 4)
    with pytest.raises(dk.SplitError, match=r"already split; call .unsplit\(\)"):
        dk.Pipeline(model, plan, chunks=2)
    split.unsplit()
    pipe = dk.Pipeline(model, plan, chunks=2)
    torch.testing.assert_close(pipe(torch.ones(4, 16)), model(torch.ones(4, 16)))
    gpu_plan = dk.plan_devices(model, {5: "1GiB"})
    with pytest.raises(dk.InvalidDeviceError, match="'cuda:5'"):
        dk.split(model, gpu_plan)
    with pytest.raises(dk.SplitError, match="places .1. but model Sequential has no such submodule; plan this model"):
        dk.split(nn.Sequential(nn.Linear(16, 4)), plan)
