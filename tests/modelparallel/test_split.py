"""dk.split: same outputs and gradients as the unsplit model; clear refusals; the plan table."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from rich.console import Console
from torch import nn

import devicekit as dk
from tests.modelparallel.modelpar_models import (
    MODELS,
    assert_same_grads,
    loss_of,
    reference_run,
    sample_for,
)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("parts", [2, 3, 4])
def test_split_matches_unsplit_model(name: str, parts: int) -> None:
    x = sample_for(name)
    ref, want = reference_run(MODELS[name], x)
    model = dk.split(MODELS[name](), ["cpu"] * parts, sample=x)
    assert len(model.parts) == parts and sum(model.plan.counts) == len(ref)
    out = model(x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    loss_of(out).backward()
    assert_same_grads(model.module, ref)
    for got, expected in zip(model.module.buffers(), ref.buffers(), strict=True):  # BN running stats
        torch.testing.assert_close(got, expected)


def test_split_trains_like_the_unsplit_model() -> None:
    x, target = sample_for("mlp"), torch.randn(8, 8)
    ref = MODELS["mlp"]()
    model = dk.split(MODELS["mlp"](), ["cpu", "cpu"], balance=[3, 4])
    for net in (ref, model):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(net(x), target).backward()
            opt.step()
    for got, want in zip(model.module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want)


def test_balance_by_time_and_explicit_counts() -> None:
    x = sample_for("mlp")
    timed = dk.split(MODELS["mlp"](), ["cpu", "cpu"], balance="time", sample=x)
    assert timed.plan.basis == "time"
    assert all(p.seconds is not None and p.seconds > 0 for p in timed.plan.parts)
    given = dk.split(MODELS["mlp"](), ["cpu", "cpu", "cpu"], balance=[1, 2, 4])
    assert given.plan.counts == [1, 2, 4] and given.plan.basis == "given"


def test_size_balance_puts_the_big_layer_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 256), nn.Linear(256, 256), nn.Linear(256, 4))
    split = dk.split(model, ["cpu", "cpu"])
    assert split.plan.counts == [3, 1] or split.plan.counts == [2, 2]
    big = max(split.plan.parts, key=lambda p: p.memory)
    assert "2" in big.layer_names


def test_plan_is_a_readable_table() -> None:
    x = sample_for("cnn_bn")
    plan = dk.split(MODELS["cnn_bn"](), ["cpu", "cpu"], sample=x).plan
    text = str(plan)
    assert "largest/mean part" in text and "parameters" in text and "memory" in text
    assert plan.max_over_mean >= 1.0
    assert sum(p.parameters for p in plan.parts) == sum(p.numel() for p in MODELS["cnn_bn"]().parameters())
    console = Console(file=io.StringIO(), width=160, record=True)
    console.print(plan)
    assert "cpu" in console.export_text()
    assert set(plan.device_map) == {str(i) for i in range(9)}


def test_a_meta_sample_sizes_a_real_model() -> None:
    real = dk.split(MODELS["mlp"](), ["cpu", "cpu"], sample=torch.randn(64, 16)).plan
    meta = dk.split(MODELS["mlp"](), ["cpu", "cpu"], sample=torch.empty(64, 16, device="meta")).plan
    assert [p.memory for p in meta.parts] == [p.memory for p in real.parts]


def test_nested_sequentials_are_flattened() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 2)))
    split = dk.split(model, ["cpu", "cpu"])
    assert sum(split.plan.counts) == 3
    assert split.plan.parts[0].layer_names[0] == "0.0"


def test_profiling_leaves_the_model_untouched() -> None:
    model = MODELS["cnn_bn"]()
    before = [b.clone() for b in model.buffers()]
    dk.split(model, ["cpu", "cpu"], balance="time", sample=sample_for("cnn_bn"))
    assert all(p.grad is None for p in model.parameters())
    for got, want in zip(model.buffers(), before, strict=True):
        assert torch.equal(got, want)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.a(x))


class SequentialWithSkip(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x + super().forward(x)


@pytest.mark.parametrize("model, words", [
    (nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]), "nn.Sequential(*model_list)"),
    (nn.Sequential(), "no layers"),
])
def test_refuses_models_whose_order_is_unknown(model: nn.Module, words: str) -> None:
    with pytest.raises(dk.SplitError) as err:
        dk.split(model, ["cpu", "cpu"])
    message = str(err.value)
    assert words in message and "\n" not in message


@pytest.mark.parametrize("factory", [Residual, lambda: SequentialWithSkip(nn.Linear(4, 4), nn.Linear(4, 4))])
def test_models_with_skips_split_by_submodule(factory: object) -> None:
    """These were refused ("not a plain nn.Sequential"); any module now splits at its submodules
    and the skip across devices is computed as unsplit (tests/modelparallel/test_split_any_module.py)."""
    torch.manual_seed(0)
    ref = factory()  # type: ignore[operator]
    model = copy.deepcopy(ref)
    x = torch.randn(3, 4)
    split = dk.split(model, ["cpu", "cpu"], sample=x)
    assert split.plan.counts == [1, 1]
    torch.testing.assert_close(split(x), ref(x))


@pytest.mark.parametrize("devices, words", [
    (["gpu:0"], "did you mean 'cuda:0'"),
    (["cuda:7"], "'cuda:7'"),
    ([], "empty"),
    ("cpu", "single device"),
    ([-1], "negative"),
])
def test_bad_devices_are_one_line_errors(devices: object, words: str) -> None:
    with pytest.raises(dk.InvalidDeviceError) as err:
        dk.split(MODELS["mlp"](), devices)  # type: ignore[arg-type]
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("balance, error, words", [
    ([3, 3], dk.InvalidValueError, "sums to 6"),
    ([7], dk.InvalidValueError, "1 entries for 2"),
    ([0, 7], dk.InvalidValueError, "positive"),
    ("speed", dk.InvalidValueError, "'speed' is unknown"),
])
def test_bad_balance_is_refused(balance: object, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        dk.split(MODELS["mlp"](), ["cpu", "cpu"], balance=balance)  # type: ignore[arg-type]


def test_more_devices_than_layers_and_time_without_sample() -> None:
    with pytest.raises(dk.SplitError, match="at most 2 devices"):
        dk.split(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), ["cpu"] * 3)
    with pytest.raises(dk.SplitError, match="sample"):
        dk.split(MODELS["mlp"](), ["cpu", "cpu"], balance="time")
    with pytest.raises(dk.InvalidValueError, match="optimizer 'lion'"):
        dk.split(MODELS["mlp"](), ["cpu", "cpu"], optimizer="lion")


def test_meta_model_cannot_move_to_real_devices() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(dk.SplitError, match="meta device"):
        dk.split(model, ["cpu", "cpu"])
    assert dk.split(model, ["meta", "meta"]).plan.counts == [1, 1]
