"""dk.split for any nn.Module: the seeds' Net, a ResNet, a tied GPT, kwargs and nested inputs.

Numerics are checked over ["cpu", "cpu", ...]; device flow over ["cpu", "meta"]: the meta device
is a second device on a CPU-only machine (a cpu tensor meeting a meta tensor raises), so a unit
whose inputs were not moved, or a parent op mixing devices that is not joined, fails there.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit.modelparallel.device_flow import DeviceFlow
from devicekit.modelparallel.module_split import ModuleSplit
from devicekit.modelparallel.unit_plan import unit_costs
from tests.modelparallel.any_models import ANY_MODELS, GPT, Net, ResNet, any_sample, loss_of, twin

CASES = [("net", 2), ("resnet", 2), ("resnet", 3), ("resnet", 4), ("gpt", 2), ("gpt", 3), ("gpt", 4),
         ("two_tower", 2), ("two_tower", 3)]


def _call(model: nn.Module, x: object) -> torch.Tensor:
    return model(x, scale=0.5) if isinstance(x, dict) else model(x)


@pytest.mark.parametrize("name, parts", CASES)
def test_same_outputs_gradients_and_buffers_as_unsplit(name: str, parts: int) -> None:
    model, ref = twin(ANY_MODELS[name])
    x = any_sample(name)
    split = dk.split(model, ["cpu"] * parts, sample=x)
    assert isinstance(split, ModuleSplit) and len(split.plan.parts) == parts
    out, want = _call(split, x), _call(ref, x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    loss_of(out).backward()
    loss_of(want).backward()
    for (pname, got), expected in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert got.grad is not None, pname
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-5, rtol=1e-4)
    for got, expected in zip(model.buffers(), ref.buffers(), strict=True):  # BatchNorm running stats
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("name, parts", [("net", 2), ("resnet", 3), ("gpt", 4), ("two_tower", 3)])
def test_trains_to_the_same_parameters(name: str, parts: int) -> None:
    model, ref = twin(ANY_MODELS[name])
    x = any_sample(name)
    split = dk.split(model, ["cpu"] * parts, sample=x)
    opt = torch.optim.Adam(split.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for _ in range(4):
        for m, o in ((split, opt), (ref, ref_opt)):
            o.zero_grad()
            loss_of(_call(m, x)).backward()
            o.step()
    for got, expected in zip(split.module.state_dict().values(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_seeds_net_in_one_line_and_the_plan() -> None:
    split = dk.split(Net(), ["cpu", "cpu"])  # no sample: registration order, weights only
    assert split.plan.device_map == {"sub_network1": "cpu", "sub_network2": "cpu"}
    assert "no sample given" in str(split.plan)
    assert split.devices == [torch.device("cpu")] * 2
    assert split(torch.randn(4, 100)).shape == (4, 10)
    assert list(split.module.state_dict()) == list(Net().state_dict())


def test_tied_embeddings_stay_together_and_the_plan_says_so() -> None:
    model = GPT()
    split = dk.split(model, ["cpu", "meta"], balance=[3, 3], sample=any_sample("gpt"))
    part = split.plan.parts[0]
    assert part.layer_names[0] == "wte" and part.tied_names == ("lm_head",)
    assert split.plan.device_map["lm_head"] == "cpu" and model.lm_head.weight is model.wte.weight
    assert split.plan.tied == ["lm_head.weight = wte.weight: one tensor, on cpu (part 0); its modules run there"]
    text = str(split.plan)
    assert "+ lm_head (tied)" in text and "tied: lm_head.weight = wte.weight" in text
    assert model.pos.device.type == "cpu"  # the model's own parameter goes with its first unit
    assert "- pos: held by the model itself, placed on cpu (part 0) with its first unit" in text
    assert all(p.device.type == "meta" for p in model.blocks[-1].parameters())


def test_device_flow_over_cpu_and_meta() -> None:
    """Inputs reach each unit on its device; a skip across devices in the parent is joined."""
    net = dk.split(Net(), ["cpu", "meta"])
    assert net(torch.randn(2, 100)).device.type == "meta"
    resnet = dk.split(ResNet(), ["cpu", "meta"], balance=[3, 5], sample=any_sample("resnet"))
    assert resnet.plan.device_map["layer1.0"] == "cpu" and resnet.plan.device_map["layer1.1"] == "meta"
    out = resnet(any_sample("resnet"))  # x + self.layer1(x): x on cpu, layer1's output on meta
    assert out.device.type == "meta" and out.shape == (8, 5)
    assert resnet.mixed_moves == 1


def test_kwargs_and_nested_inputs_move_to_the_unit() -> None:
    model = ANY_MODELS["two_tower"]()
    split = dk.split(model, ["cpu", "meta"], balance=[1, 2], sample=any_sample("two_tower"))
    assert split.plan.device_map == {"left": "cpu", "right": "meta", "head": "meta"}
    # right(batch["pair"] (a tuple), bias=batch["bias"] (a keyword)) runs on meta; cat joins branches
    out = split(any_sample("two_tower"), scale=2.0)
    assert out.device.type == "meta" and out.shape == (8, 3)
    assert split.mixed_moves == 1  # torch.cat([a on cpu, b on meta])


def test_mixed_device_mode_keeps_in_place_ops_in_place() -> None:
    flow = DeviceFlow(torch.device("cpu"))
    a, b = torch.zeros(3, device="meta"), torch.ones(3)
    with flow:
        c = a.add_(b)         # written tensor decides: b goes to meta, a is changed in place
        flow.current = torch.device("meta")
        d = b * a             # out of place: where the data flows now
    assert c is a and d.device.type == "meta" and flow.mode.moves == 2
    assert (b * 2).device.type == "cpu"  # the mode is gone after the block


def test_plan_devices_on_the_meta_device_within_budgets() -> None:
    budgets = {"cuda:0": "600KiB", "cuda:1": "600KiB", "cuda:2": "600KiB", "cpu": "64MiB"}
    for name, factory in ANY_MODELS.items():
        with torch.device("meta"):
            model = factory()
        sample = any_sample(name)
        meta_sample = {k: v for k, v in sample.items()} if isinstance(sample, dict) else sample.to("meta")
        plan = dk.plan_devices(model, budgets, sample=meta_sample)
        for part in plan.parts:
            assert part.budget is not None and part.memory <= part.budget, (name, str(plan))
        assert all(p.device.type == "meta" for p in model.parameters())  # nothing allocated
        if name == "gpt":
            assert plan.tied and plan.device_map["lm_head"] == plan.device_map["wte"]
        # the same plan on CPU "devices" places the real model
        cpu_plan = replace(plan, parts=[replace(p, device=torch.device("cpu")) for p in plan.parts])
        real, ref = twin(factory)
        split = dk.split(real, cpu_plan)
        torch.testing.assert_close(_call(split, sample), _call(ref, sample))


def test_a_unit_bigger_than_every_budget_is_refused() -> None:
    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.Linear(8, 8)
            self.huge = nn.Linear(8, 4096)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.huge(self.small(x))

    with torch.device("meta"):
        model = Wide()
    with pytest.raises(dk.SplitError) as err:
        dk.plan_devices(model, {"cuda:0": "64KiB", "cuda:1": "64KiB"}, sample=torch.empty(2, 8, device="meta"))
    message = str(err.value)
    assert "'huge' (Linear)" in message and "add a device" in message and "'cpu'" in message
    assert "\n" not in message


def test_a_too_big_block_is_opened_into_its_submodules() -> None:
    with torch.device("meta"):
        model = ResNet(width=16)
    sample = torch.empty(4, 3, 8, 8, device="meta")
    measured = unit_costs(model, sample)
    sizes = {name: c.memory() for (name, _), c in zip(measured.sequence, measured.costs, strict=True)}
    working = max(c.transient_bytes for c in measured.costs)
    assert max(sizes, key=sizes.__getitem__) == "layer2.1"
    budget = int(0.8 * sizes["layer2.1"]) + working  # no GPU holds layer2.1 whole
    plan = dk.plan_devices(model, {f"cuda:{i}": budget for i in range(8)}, sample=sample)
    assert "layer2.1" not in plan.device_map and "layer2.1.conv1" in plan.device_map, str(plan)
    assert all(p.memory <= budget for p in plan.parts)


def test_moving_a_split_model_as_a_whole_is_refused() -> None:
    split = dk.split(Net(), ["cpu", "cpu"])
    assert split.to("cpu") is split and split.cpu() is split  # already there: a no-op
    for call in (lambda: split.to("meta"), lambda: split.cuda(),
                 lambda: split.to(torch.device("meta"), torch.float64)):
        with pytest.raises(dk.SplitError) as err:
            call()
        assert "split model" in str(err.value) and "unsplit()" in str(err.value) and "\n" not in str(err.value)
    split.to(torch.float64)  # a dtype alone is fine
    assert split.module.sub_network1.weight.dtype == torch.float64


def test_unsplit_and_split_again() -> None:
    model = Net()
    split = dk.split(model, ["cpu", "meta"])
    with pytest.raises(dk.SplitError, match="already split"):
        dk.split(model, ["cpu", "cpu"])
    plain = split.unsplit()
    assert plain is model
    again = dk.split(plain, ["meta", "meta"])
    assert again(torch.randn(2, 100)).device.type == "meta"


def test_uncalled_and_repeated_units() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 99)
            self.out = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.shared(torch.relu(self.shared(x))))  # one module, called twice

    model, ref = twin(Odd)
    x = torch.randn(3, 4)
    split = dk.split(model, ["cpu", "meta"], balance=[2, 1], sample=x)
    assert split.plan.device_map == {"shared": "cpu", "unused": "cpu", "out": "meta"}
    assert model.unused.weight.device.type == "cpu"  # never called, still placed
    assert split(x).device.type == "meta"
    model2, ref2 = twin(Odd)
    split2 = dk.split(model2, ["cpu", "cpu", "cpu"], sample=x)
    torch.testing.assert_close(split2(x), ref2(x))


def test_balance_options_and_refusals() -> None:
    x = any_sample("gpt")
    timed = dk.split(GPT(), ["cpu", "cpu"], balance="time", sample=x)
    assert timed.plan.basis == "time" and all(p.seconds is not None for p in timed.plan.parts)
    with pytest.raises(dk.SplitError, match="sample"):
        dk.split(GPT(), ["cpu", "cpu"], balance="time")
    with pytest.raises(dk.InvalidValueError, match="sums to 3"):
        dk.split(GPT(), ["cpu", "cpu"], balance=[1, 2], sample=x)
    with pytest.raises(dk.SplitError, match="at most 2 devices"):
        dk.split(Net(), ["cpu"] * 3)
    with pytest.raises(dk.SplitError, match="no submodules"):
        dk.split(nn.Linear(2, 2), ["cpu", "cpu"])
    with pytest.raises(dk.SplitError, match="failed on the sample"):
        dk.split(Net(), ["cpu", "cpu"], sample=torch.randn(2, 7))
    with torch.device("meta"):
        meta = Net()
    with pytest.raises(dk.SplitError, match="meta device"):
        dk.split(meta, ["cpu", "cpu"])


def test_profiling_leaves_the_model_as_it_was() -> None:
    model = ResNet().eval()
    before = copy.deepcopy(model.state_dict())
    dk.split(model, ["cpu", "cpu"], balance="time", sample=any_sample("resnet"))
    assert not model.training and all(not m.training for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])


def test_sequential_models_keep_the_sequential_split() -> None:
    split = dk.split(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), ["cpu", "cpu"])
    assert isinstance(split, dk.SplitModel)
