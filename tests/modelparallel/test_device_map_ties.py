"""accelerate's device-map tests with tied weights, ported to dk.plan_devices (issue 18, item 3).

accelerate/tests/test_modeling_utils.py (test_infer_auto_device_map_with_tied_weights): three
``ModelForTest`` blocks (Linear(3, 4), BatchNorm1d(4), Linear(4, 5): 236 B each) in an
``nn.Sequential``, ``layer3.linear2.weight`` tied to ``layer1.linear2.weight``, budgets
``{0: 400, 1: 500}``, inference. Where devicekit's answer differs from accelerate's the test
says why. Everything runs on the meta device (budgets name GPUs; nothing is allocated), and the
plans are then run and trained on CPU stand-ins for the GPUs.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import replace

import pytest
import torch
from torch import nn

import devicekit as dk


class ModelForTest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.batchnorm(self.linear1(x)))


class Adapter(ModelForTest):
    """ModelForTest whose output feeds the next block (5 -> 3), for running the chain."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[:, :3]


class ThreeBlocks(nn.Module):
    """The same three blocks inside a custom module: the other spelling of the Sequential."""

    def __init__(self, blocks: nn.Sequential) -> None:
        super().__init__()
        self.layer1, self.layer2, self.layer3 = blocks.layer1, blocks.layer2, blocks.layer3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer3(self.layer2(self.layer1(x)))


def blocks(kind: type[nn.Module] = ModelForTest, device: str = "meta") -> nn.Sequential:
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(OrderedDict((f"layer{i}", kind()) for i in (1, 2, 3)))


def tie(model: nn.Module, *pairs: str) -> nn.Module:
    """Tie ``"layer3.linear2=layer1.linear2"``-style pairs (weights), as accelerate's test does."""
    for pair in pairs:
        target, source = pair.split("=")
        model.get_submodule(target).weight = model.get_submodule(source).weight
    return model


BUDGETS = {0: 400, 1: 500}


def device_map(plan: dk.Plan) -> dict[str, int]:
    return {name: torch.device(d).index for name, d in plan.device_map.items()}


def within_budgets(plan: dk.Plan) -> None:
    assert all(p.budget is not None and p.memory <= p.budget for p in plan.parts), str(plan)


def test_tie_between_non_neighbouring_layers_plans_in_both_spellings() -> None:
    seq = tie(blocks(), "layer3.linear2=layer1.linear2")
    plan = dk.plan_devices(seq, BUDGETS, training=False)
    # accelerate: {"layer1": 0, "layer3.linear2": 0, "layer2": 1, "layer3.linear1": 1,
    # "layer3.batchnorm": 1}; devicekit keeps layer3 whole next to layer1 (both fit: 392 B)
    assert device_map(plan) == {"layer1": 0, "layer3": 0, "layer2": 1}
    within_budgets(plan)
    assert [p.memory for p in plan.parts] == [236 + 156, 236]  # the shared 80 B counted once
    assert plan.tied == ["layer3.linear2.weight = layer1.linear2.weight: one tensor, on cuda:0 (part 0); "
                         "its modules run there"]
    custom = dk.plan_devices(ThreeBlocks(seq), BUDGETS, training=False)
    assert custom.device_map == plan.device_map and custom.tied == plan.tied
    assert [p.memory for p in custom.parts] == [p.memory for p in plan.parts]


def test_three_weights_tied_together() -> None:
    seq = tie(blocks(), "layer3.linear2=layer1.linear2", "layer2.linear2=layer1.linear2")
    plan = dk.plan_devices(seq, BUDGETS, training=False)
    # the tie group (all three blocks, 548 B) fits no budget, so the blocks are opened; the same
    # map as accelerate's, with layer1 spelled as its three submodules
    assert device_map(plan) == {
        "layer1.linear1": 0, "layer1.batchnorm": 0, "layer1.linear2": 0,
        "layer2.linear2": 0, "layer3.linear2": 0,
        "layer2.linear1": 1, "layer2.batchnorm": 1, "layer3.linear1": 1, "layer3.batchnorm": 1,
    }
    within_budgets(plan)
    assert plan.parts[0].tied_names == ("layer2.linear2", "layer3.linear2")
    assert device_map(dk.plan_devices(ThreeBlocks(seq), BUDGETS, training=False)) == device_map(plan)


def test_two_groups_of_tied_weights() -> None:
    seq = tie(blocks(), "layer3.linear2=layer1.linear2", "layer2.linear2=layer1.linear2",
              "layer2.linear1=layer1.linear1")
    # with accelerate's budgets {0: 400, 1: 500} the whole model (500 B once shared weights count
    # once) fits on cuda:1 alone, and devicekit uses the fewest devices
    assert device_map(dk.plan_devices(seq, BUDGETS, training=False)) == {"layer1": 1, "layer2": 1, "layer3": 1}
    # with {0: 400, 1: 400} it must cut, and gives accelerate's map
    plan = dk.plan_devices(seq, {0: 400, 1: 400}, training=False)
    assert device_map(plan) == {
        "layer1.linear1": 0, "layer2.linear1": 0, "layer1.batchnorm": 0, "layer1.linear2": 0,
        "layer2.linear2": 0, "layer3.linear2": 0,
        "layer2.batchnorm": 1, "layer3.linear1": 1, "layer3.batchnorm": 1,
    }
    within_budgets(plan)
    assert len(plan.tied) == 3  # layer2.linear1 = layer1.linear1, and the two linear2 ties


def test_weights_tied_within_a_sequential_of_linears() -> None:
    with torch.device("meta"):
        seq = nn.Sequential(OrderedDict([("linear1", nn.Linear(4, 4)), ("linear2", nn.Linear(6, 6)),
                                         ("linear3", nn.Linear(4, 4)), ("linear4", nn.Linear(6, 6))]))
    seq.linear3.weight = seq.linear1.weight
    seq.linear3.bias = seq.linear1.bias
    plan = dk.plan_devices(seq, {0: 250, 1: 400}, training=False)
    # accelerate fills device 0 first: {"linear1": 0, "linear2": 1, "linear3": 0, "linear4": 1};
    # devicekit balances the largest part down (248 B | 168 B rather than 80 B | 336 B)
    assert device_map(plan) == {"linear1": 0, "linear3": 0, "linear2": 0, "linear4": 1}
    assert [p.memory for p in plan.parts] == [80 + 168, 168]
    within_budgets(plan)


def test_a_tie_that_fits_nowhere_is_refused_naming_it() -> None:
    with torch.device("meta"):  # four Linear(6, 6) of 168 B; linear1 and linear4 share a weight
        seq = nn.Sequential(OrderedDict((f"linear{i}", nn.Linear(6, 6)) for i in range(1, 5)))
    seq.linear4.weight = seq.linear1.weight
    with pytest.raises(dk.SplitError) as err:
        dk.plan_devices(seq, {0: 180, 1: 180}, training=False)  # 192 B for the pair, 168 B alone
    message = str(err.value)
    assert "unit 'linear1' (Linear)" in message and "\n" not in message
    assert "linear4.weight = linear1.weight (tied units linear1, linear4)" in message


def test_a_pipeline_states_what_it_needs_and_refuses_the_non_consecutive_map() -> None:
    seq = tie(blocks(), "layer3.linear2=layer1.linear2")
    plan = dk.plan_devices(seq, BUDGETS, training=False)
    with pytest.raises(dk.SplitError) as err:
        dk.Pipeline(seq, plan, chunks=2)
    message = str(err.value)
    assert "layer 'layer3' on cuda:0 with 'layer1' (tied: layer3.linear2.weight = layer1.linear2.weight)" in message
    assert "after layer 'layer2' on cuda:1" in message and "each part must be consecutive layers" in message
    with pytest.raises(dk.SplitError) as err:  # devices for the pipeline: the tie spans the chain
        dk.Pipeline(seq, ["meta", "cpu"], chunks=2)
    assert "'layer1.linear2.weight' is shared (tied) with 'layer3.linear2.weight'" in str(err.value)
    assert "used by layers 'layer1', 'layer3'" in str(err.value)
    opened = dk.plan_devices(tie(blocks(), "layer2.linear2=layer1.linear2", "layer3.linear2=layer1.linear2"),
                             BUDGETS, training=False)
    with pytest.raises(dk.SplitError, match="places layer 'layer1' in pieces"):
        dk.Pipeline(seq, opened, chunks=2)


def on_cpu(plan: dk.Plan) -> dk.Plan:
    """The plan with every GPU replaced by the CPU: its map, runnable on this machine."""
    return replace(plan, parts=[replace(p, device=torch.device("cpu")) for p in plan.parts])


THREE_TIED = ("layer3.linear2=layer1.linear2", "layer2.linear2=layer1.linear2")


@pytest.mark.parametrize("ties", [THREE_TIED[:1], THREE_TIED], ids=["whole-blocks", "opened-blocks"])
@pytest.mark.parametrize("spelling", ["sequential", "custom"])
def test_the_planned_map_trains_like_the_unsplit_model(spelling: str, ties: tuple[str, ...]) -> None:
    """Whole blocks: a Sequential's split routes each layer's input itself; opened blocks (the
    three-tied plan): hooks place the pieces. Both train as the unsplit model."""
    ref = tie(blocks(Adapter, "cpu"), *ties)
    plan = dk.plan_devices(tie(blocks(Adapter), *ties), BUDGETS, training=False)
    model = copy.deepcopy(ref)
    net = model if spelling == "sequential" else ThreeBlocks(model)
    split = dk.split(net, on_cpu(plan))
    assert isinstance(split, dk.ModuleSplit)
    assert isinstance(split, dk.SplitModel) == (spelling == "sequential")
    assert [(p.layer_names, p.tied_names) for p in split.plan.parts] == [
        (p.layer_names, p.tied_names) for p in plan.parts]
    assert len(plan.parts[0].layer_names) == (1 if len(ties) == 1 else 3)
    torch.manual_seed(1)
    x, target = torch.randn(8, 3), torch.randn(8, 3)
    for module in (ref, split):
        for _ in range(2):  # plain SGD by hand: torch.optim's first step imports dynamo (seconds)
            module.zero_grad()
            nn.functional.mse_loss(module(x), target).backward()
            with torch.no_grad():
                for p in module.parameters():
                    p -= 0.1 * p.grad
    assert model.layer3.linear2.weight is model.layer1.linear2.weight  # still one tensor
    assert split.unsplit() is net
    for (name, got), want in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, msg=name)
    for got, want in zip(model.buffers(), ref.buffers(), strict=True):  # BatchNorm running stats
        torch.testing.assert_close(got, want)


def test_a_pipeline_takes_a_plan_whose_parts_are_consecutive() -> None:
    """A tie between neighbours, or a layer listed again next to itself, keeps the parts
    consecutive: the pipeline re-reads the plan in layer order and runs it."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(4, 4), lin, lin, nn.Tanh(), nn.Linear(4, 4))
    model[0].weight = model[1].weight  # a tie between neighbours 0 and 1; 1 and 2 are one object
    plan = dk.plan_devices(model, {"cpu": "1GiB"}, sample=torch.randn(2, 4))
    assert plan.counts == [3] and plan.parts[0].tied_names == ("1",)  # groups: 0+1, 3, 4
    x = torch.randn(6, 4)
    want = model(x)
    with dk.Pipeline(model, plan, chunks=2) as pipe:
        assert pipe.plan.counts == [5]  # the chain's five layers, layer 2 again with layer 1
        torch.testing.assert_close(pipe(x), want)
    lin2 = nn.Linear(4, 4)
    repeated = nn.Sequential(lin2, nn.ReLU(), lin2)
    split = dk.split(repeated, ["cpu", "cpu"])  # '2' is '0': one unit, on part 0; '1' on part 1
    split_plan = split.plan
    split.unsplit()
    with pytest.raises(dk.SplitError, match="layer '2' on cpu with '0' \\(the same module\\)"):
        dk.Pipeline(repeated, split_plan, chunks=2)


def test_too_many_devices_for_the_tie_groups_names_the_tie() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    with pytest.raises(dk.SplitError) as err:
        dk.split(model, ["cpu"] * 3)
    message = str(err.value)
    assert "cannot cut 2 unit(s) of Sequential into 3 parts" in message and "\n" not in message
    assert "tied units stay on one device: 2.weight = 0.weight (tied units 0, 2)" in message
    assert "pass at most 2 devices" in message
