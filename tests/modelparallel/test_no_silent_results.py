"""Issue 9 item 3: five ways dk.split / dk.Pipeline gave silently wrong results, each now right
or refused in one line naming the layer or parameter. Every test here failed on the old code."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import devicekit as dk
from devicekit.modelparallel.recompute import is_recomputing

# --- a) a layer object listed twice runs twice -------------------------------------------------


def test_a_repeated_layer_runs_as_many_times_as_it_appears() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(2, 2)
    x = torch.randn(4, 2)
    want = lin(lin(x))
    for model in (dk.split(nn.Sequential(lin, lin), ["cpu"]),
                  dk.split(nn.Sequential(lin, lin), ["cpu"], balance=[1])):
        assert model.plan.counts == [1]  # one module object is one unit, run at both places
        torch.testing.assert_close(model(x), want)
        model.unsplit()
    with pytest.raises(dk.SplitError, match="cannot cut 1 unit"):
        dk.split(nn.Sequential(lin, lin), ["cpu", "cpu"])
    with dk.Pipeline(nn.Sequential(lin, nn.Tanh(), lin), ["cpu", "cpu"], chunks=2) as pipe:
        torch.testing.assert_close(pipe(x), lin(torch.tanh(lin(x))))
        assert "repeats as '2'" in str(pipe.plan)  # on one CPU the two uses share one copy


def test_a_repeated_layer_stays_on_one_device() -> None:
    lin = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(4, 4), lin, nn.ReLU(), lin, nn.Linear(4, 4))
    split = dk.split(model, ["cpu", "meta"])
    assert "3" not in split.plan.device_map  # the module registered as '1' and '3' is placed once
    assert any("layer '1' repeats as '3'" in r and "kept on one device" in r for r in split.plan.reasons)
    x = torch.randn(2, 4)
    assert split(x).shape == (2, 4)
    split.unsplit()
    with pytest.raises(dk.InvalidValueError, match="sums to 5 but the model has 4 units"):
        dk.split(model, ["cpu", "meta"], balance=[2, 3])
    with pytest.raises(dk.SplitError, match="pass at most 4 devices"):
        dk.split(model, ["cpu", "meta", "cpu", "meta", "cpu"])
    with pytest.raises(dk.SplitError) as err:  # a pipeline cuts between places: the repeat is named
        dk.Pipeline(model, ["cpu", "meta"], chunks=2, balance=[2, 3])
    assert "layer '1' repeats as '3'" in str(err.value) and "\n" not in str(err.value)


def test_a_repeated_batchnorm_is_refused_by_a_deferred_pipeline() -> None:
    bn = nn.BatchNorm1d(4)
    model = nn.Sequential(bn, nn.Linear(4, 4), bn)
    converted = dk.DeferredBatchNorm.convert(model)
    assert type(converted[0]) is dk.DeferredBatchNorm and converted[0] is converted[2]
    with pytest.raises(dk.SplitError, match="deferred_batch_norm=False"):
        dk.Pipeline(nn.Sequential(bn, nn.Linear(4, 4), bn), ["cpu", "cpu"], chunks=2)
    pipe = dk.Pipeline(nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4)),
                       ["cpu", "cpu"], chunks=2, deferred_batch_norm=False)
    assert pipe(torch.randn(8, 4)).shape == (8, 4)


# --- b) tied parameters ------------------------------------------------------------------------


class Embed(nn.Module):
    def __init__(self, table: nn.Embedding) -> None:
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids)


class TiedHead(nn.Module):
    def __init__(self, table: nn.Embedding) -> None:
        super().__init__()
        self.table = table

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.table.weight.t()


def tied_model() -> nn.Sequential:
    torch.manual_seed(0)
    table = nn.Embedding(20, 16)
    return nn.Sequential(Embed(table), nn.Linear(16, 16), nn.ReLU(), TiedHead(table))


def test_b_tied_parameters_across_devices_stay_together_and_a_pipeline_names_the_tie() -> None:
    """dk.split keeps the tied embedding and head on one device wherever they are (issue 18: the
    Sequential used to be refused here); a pipeline, whose parts run in order, cannot, and says
    which parameter ties which layers."""
    for balance in ("size", [2, 1], [1, 2]):
        split = dk.split(tied_model(), ["cpu", "meta"], balance=balance)  # type: ignore[arg-type]
        assert split.plan.device_map["0"] == split.plan.device_map["3"]
        assert any(t.startswith("3.table.weight = 0.table.weight") for t in split.plan.tied)
    for balance in ("size", [2, 2], [1, 3]):
        with pytest.raises(dk.SplitError) as err:
            dk.Pipeline(tied_model(), ["cpu", "meta"], chunks=2, balance=balance)  # type: ignore[arg-type]
        message = str(err.value)
        assert "parameter '0.table.weight' is shared (tied) with '3.table.weight', used by layers '0', '3'" in message
        assert "\n" not in message


def test_b_tied_parameters_on_one_device_share_one_copy_and_the_plan_says_so() -> None:
    ids = torch.randint(0, 20, (6, 5))
    ref = tied_model()
    ref(ids).square().mean().backward()
    split = dk.split(tied_model(), ["cpu", "cpu"], balance=[2, 1])
    out = split(ids)
    out.square().mean().backward()
    torch.testing.assert_close(out, ref(ids))
    torch.testing.assert_close(split.module[0].table.weight.grad, ref[0].table.weight.grad)
    assert split.module[0].table.weight is split.module[3].table.weight
    assert split.plan.parts[0].tied_names == ("3",)
    assert any("one tensor, on cpu (part 0)" in t for t in split.plan.tied)
    # counted once: the plan's parameters are the model's
    assert sum(p.parameters for p in split.plan.parts) == sum(p.numel() for p in ref.parameters())


def test_b_plan_devices_keeps_tied_layers_on_one_gpu() -> None:
    with torch.device("meta"):
        table = nn.Embedding(4096, 256)
        model = nn.Sequential(Embed(table), nn.Linear(256, 4096), nn.Linear(4096, 256), TiedHead(table),
                              nn.Linear(4096, 256))  # five layers of 1M parameters (the head's are the table's)
    plan = dk.plan_devices(model, {"cuda:0": "40GiB", "cuda:1": "40GiB"}, spread=True,
                           sample=torch.empty(2, 8, dtype=torch.long, device="meta"))
    # the head joins the table's part and the rest balances: [embed + head, 1 | 2, 4] (the layer
    # rule of the old Sequential path kept layers 0..3 together: [4, 1])
    assert plan.counts == [2, 2]
    assert plan.device_map["0"] == plan.device_map["3"] != plan.device_map["4"]
    assert any("3.table.weight = 0.table.weight" in t for t in plan.tied)
    with pytest.raises(dk.SplitError, match="'3.table.weight' is the same tensor as '0.table.weight'"):
        dk.split(model, _cut(plan, [3, 2]))  # a hand-edited plan that cuts the tie
    with pytest.raises(dk.SplitError, match="a pipeline runs its parts one after another"):
        dk.Pipeline(model, plan, chunks=2)  # layer 3 joins part 0 after layer 2 on part 1


def _cut(plan: dk.Plan, counts: list[int]) -> dk.Plan:
    """The plan's devices with other layer counts (a hand-edited plan)."""
    from devicekit.modelparallel.partition import Part

    parts, start = [], 0
    for part, n in zip(plan.parts, counts, strict=True):
        parts.append(Part(index=part.index, device=torch.device("meta") if part.index else
                          torch.device("cpu"), start=start, stop=start + n,
                          layer_names=tuple(str(i) for i in range(start, start + n)),
                          parameters=0, memory=0))
        start += n
    return dk.Plan(parts=parts, basis="given")


# --- c) moving a split model or a pipeline as a whole --------------------------------------------


@pytest.mark.parametrize("kind", ["split", "pipeline"])
def test_c_moving_as_a_whole_is_refused_and_dtype_casts_are_fine(kind: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    wrapped: nn.Module = (dk.split(model, ["cpu", "meta"], balance=[2, 1]) if kind == "split" else
                          dk.Pipeline(model, ["cpu", "meta"], chunks=2, balance=[2, 1]))
    moves = [lambda m: m.cpu(), lambda m: m.cuda(), lambda m: m.to("meta"), lambda m: m.to(1),
             lambda m: m.to(device="cpu"), lambda m: m.to(torch.zeros(1)),
             lambda m: m.to("cpu", torch.float64), lambda m: m.to_empty(device="cpu")]
    for move in moves:
        with pytest.raises(dk.PlacementError) as err:
            move(wrapped)
        assert "as planned" in str(err.value) and "\n" not in str(err.value)
    assert [str(d) for d in wrapped.devices] == ["cpu", "meta"]
    assert model[0].weight.device.type == "cpu" and model[2].weight.device.type == "meta"
    wrapped.to(torch.float64)
    assert model[0].weight.dtype == torch.float64 and model[0].weight.device.type == "cpu"
    wrapped.float()
    assert wrapped(torch.randn(4, 3)).device.type == "meta"


def test_c_a_no_op_move_is_allowed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    split = dk.split(model, ["cpu", "cpu"])
    assert split.cpu() is split and split.to("cpu") is split
    split.to(torch.float64)
    assert split(torch.randn(2, 3, dtype=torch.float64)).dtype == torch.float64
    with pytest.raises(dk.PlacementError, match=r"\.cuda\(\) would move every part"):
        split.cuda()


# --- d) functional dropout in a custom layer, replayed by checkpointing ---------------------------


class FunctionalDropout(nn.Module):
    """A custom layer calling F.dropout twice with a pause between (so stage threads interleave);
    it records the masks its first runs drew (not the recomputation's)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.masks: list[list[torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        masks = []
        for _ in range(2):
            kept = F.dropout(torch.ones_like(h), 0.5, self.training)
            h = h * kept
            masks.append(kept.detach())
            time.sleep(0.002)
        if not is_recomputing():
            self.masks.append(masks)
        return h


class FixedMasks(nn.Module):
    """The reference: the same layer applying given masks."""

    def __init__(self, layer: FunctionalDropout, masks: list[list[torch.Tensor]]) -> None:
        super().__init__()
        self.linear = layer.linear
        self.masks = list(masks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        for kept in self.masks.pop(0):
            h = h * kept
        return h


def check_functional_dropout(devices: list[str], checkpoint: str) -> None:
    """A pipeline of FunctionalDropout layers on ``devices`` gets the gradients of its own masks."""
    torch.manual_seed(0)
    chunks, x = 4, torch.randn(16, 16)
    layers = [FunctionalDropout(), FunctionalDropout()]
    model = nn.Sequential(layers[0], nn.Tanh(), layers[1], nn.Linear(16, 1))
    with dk.Pipeline(model, devices, chunks=chunks, balance=[2, 2], checkpoint=checkpoint) as pipe:
        assert len({str(d) for d in pipe.devices}) == 1  # two stages, one generator
        for _ in range(2):  # the second call too (the pipeline remembers it must not overlap)
            model.zero_grad()
            for layer in layers:
                layer.masks.clear()
            inp = x.clone().requires_grad_(True)
            pipe(inp).square().sum().backward()
            # the reference: the same parameters, the masks the pipeline's forward drew
            fixed = [FixedMasks(layer, layer.masks[-chunks:]) for layer in layers]
            ref = nn.Sequential(fixed[0], nn.Tanh(), fixed[1], model[3])
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad()
            ref_in = x.clone().to(pipe.devices[0]).requires_grad_(True)
            torch.cat([ref(c) for c in ref_in.chunk(chunks)]).square().sum().backward()
            for name, param in model.named_parameters():
                torch.testing.assert_close(grads[name], param.grad, msg=name)
            torch.testing.assert_close(inp.grad, ref_in.grad.cpu())


@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
def test_d_functional_dropout_gets_the_gradients_of_its_own_masks(checkpoint: str) -> None:
    check_functional_dropout(["cpu", "cpu"], checkpoint)


# --- e) no recomputation in eval mode; time profiling in training mode ---------------------------


def test_e_no_recomputation_in_eval_mode() -> None:
    calls: list[int] = []

    class Counting(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            return x * 2

    model = nn.Sequential(Counting(), nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = dk.Pipeline(model, ["cpu", "cpu"], chunks=4, balance=[2, 1], checkpoint="always")
    pipe.eval()
    pipe(torch.randn(8, 4)).sum().backward()  # grad enabled, but eval: nothing is recomputed
    assert len(calls) == 4
    pipe.train()
    calls.clear()
    pipe(torch.randn(8, 4)).sum().backward()
    assert len(calls) == 8
    pipe.close()


def test_e_time_balance_profiles_in_training_mode_and_restores_the_mode() -> None:
    class TrainingOnly(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert self.training, "only works in training mode"
            return x + 1

    model = nn.Sequential(nn.Linear(4, 4), TrainingOnly(), nn.Linear(4, 4), nn.Dropout(0.5))
    model.eval()
    split = dk.split(model, ["cpu", "cpu"], balance="time", sample=torch.randn(8, 4))
    assert split.plan.basis == "time"
    assert not any(m.training for m in model.modules())
    model[0].train()  # a mix of modes comes back as it was
    split.unsplit()
    dk.split(model, ["cpu", "cpu"], balance="size", sample=torch.randn(8, 4))
    assert [m.training for m in model] == [True, False, False, False]
