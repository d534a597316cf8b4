"""How a step is sized when fake tensors are not the whole story (devicekit.memory.sizing): a
newcomer's models that the estimate under-counted by 40-94 % without a word, or ran real steps
at batch 128 to find a shape error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit.errors import InvalidValueError
from devicekit.memory import sizing
from devicekit.memory.losses import cross_entropy_loss
from tests.memory.memory_truth import measured_peak


class _Trim(nn.Module):
    """Drops the padding columns (token 0) before the layers, as many LM pipelines do."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ff, self.head = nn.Embedding(1000, 64), nn.Linear(64, 256), nn.Linear(256, 1000)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens[:, :max(int((tokens != 0).sum(1).max()), 1)]
        return self.head(torch.relu(self.ff(self.emb(tokens))))


def test_real_steps_run_on_the_callers_own_rows_when_the_shapes_follow_the_values() -> None:
    torch.manual_seed(0)
    model, tokens = _Trim(), torch.randint(1, 1000, (32, 128))     # no padding: every column kept
    est = dk.estimate_memory(model, tokens)
    truth = measured_peak(model, tokens, loss_fn=cross_entropy_loss)
    assert abs(est.peak / truth - 1) <= 0.02, (est.peak, truth)      # zeros as tokens: -90 %
    assert "rows of the batch you gave" in est.method


def test_a_sample_of_shapes_only_says_its_stand_in_values_are_not_the_data() -> None:
    torch.manual_seed(0)
    est = dk.estimate_memory(_Trim(), torch.empty(32, 128, dtype=torch.long, device="meta"))
    assert "stand-in values" in est.method and "pass a real batch" in est.method


class _Survival(nn.Module):
    """Stochastic depth written 'run the block when the draw is below the survival rate'."""

    def __init__(self, survival: float = 0.8) -> None:
        super().__init__()
        self.survival = survival
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
                                    for _ in range(6))
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if torch.rand(1) < self.survival:
                x = x + block(x)
        return self.head(x)


def test_layers_run_below_a_rate_are_sized_as_all_running() -> None:
    """The draw just below 1 that keeps LayerDrop's layers skipped every one of these (-75 %)."""
    x = torch.randn(64, 64)
    torch.manual_seed(0)
    est = dk.estimate_memory(_Survival(), x)
    torch.manual_seed(0)
    every_block = measured_peak(_Survival(survival=1.0), x, loss_fn=cross_entropy_loss)
    assert est.peak == every_block
    assert "6 one-number random draw(s)" in est.method and "the larger kept" in est.method


def test_a_model_without_draws_is_sized_once(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[int] = []
    size_once = sizing._size_once

    def counted(*args: Any, **kwargs: Any) -> Any:
        runs.append(1)
        return size_once(*args, **kwargs)

    monkeypatch.setattr(sizing, "_size_once", counted)
    est = dk.estimate_memory(nn.Linear(8, 4), torch.randn(16, 8))
    assert len(runs) == 1 and "draw" not in est.method


class _WrongHead(nn.Module):
    """A head sized for 8x8 images, given 16x16 ones: it fails for real, at any batch."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).flatten(1))


def test_a_real_failure_is_found_by_two_samples_not_by_batches_of_128(monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[tuple[int, ...]] = []
    real_peaks = sizing.real_peaks

    def recorded(*args: Any, batches: tuple[int, ...], **kwargs: Any) -> Any:
        tried.append(batches)
        return real_peaks(*args, batches=batches, **kwargs)

    monkeypatch.setattr(sizing, "real_peaks", recorded)
    with pytest.raises(InvalidValueError, match=r"failed on the sample \[\(512, 3, 16, 16\)\]: RuntimeError"):
        dk.estimate_memory(_WrongHead(), torch.empty(512, 3, 16, 16, device="meta"))
    assert tried == [(2,)]


def test_real_steps_that_cannot_fit_this_machine_are_refused_not_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizing, "real_peaks", lambda *a, **k: pytest.fail("a real step was tried"))
    with pytest.raises(InvalidValueError, match=r"need at least .*more than half of this machine's free memory"):
        dk.estimate_memory(nn.Linear(10, 10), torch.empty(64, 100000, 100000, 100000, device="meta"))


class _Positive(nn.Module):
    """Keeps the positive entries: a shape that depends on values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x[x > 0].reshape(-1, 4)[:2])


def _refused(**kwargs: Any) -> str:
    with pytest.raises(InvalidValueError) as caught:
        dk.estimate_memory(**kwargs)
    return str(caught.value)


def test_each_refusal_names_its_cause() -> None:
    """A newcomer's list: the two forward-only refusals were swapped, a failing step was blamed
    on the model, a frozen model was pointed at its sample, a long sample was sized."""
    said = _refused(model=_Positive(), sample=torch.randn(8, 4), training=False)
    assert "cannot run on fake tensors" in said and "depend on values" in said
    said = _refused(model=nn.Linear(10, 10), sample=torch.zeros(8, 11), training=False)
    assert said.startswith("model Linear failed on the sample [(8, 11)]: RuntimeError")

    def bad_step(model: nn.Module, x: torch.Tensor) -> None:
        raise ValueError("step blew up")

    said = _refused(model=nn.Linear(10, 10), sample=torch.zeros(8, 10), step=bad_step)
    assert said.startswith("your step bad_step (model Linear) failed on the sample")
    said = _refused(model=nn.Linear(10, 10), sample=torch.zeros(8, 10), step=lambda m, x: m(x).sum())
    assert "made no gradients" in said and "loss.backward()" in said
    said = _refused(model=nn.ReLU(), sample=torch.zeros(8, 10))
    assert "no trainable parameters" in said and "optimizer=None" in said
    for sample in (torch.zeros(8, 10, dtype=torch.long), torch.empty(8, 10, dtype=torch.long, device="meta")):
        said = _refused(model=nn.Linear(10, 10), sample=sample)
        assert "failed on the sample [(8, 10)]" in said and "float32 and int64" in said


def test_the_first_try_is_not_refused_by_batch_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the fake step fails for a reason of its own, the try at a small batch must not fail
    for a reason of the batch's (batch norm in training refuses a batch of 1)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    fake_step = sizing.fake_step

    def stricter(*args: Any, **kwargs: Any) -> Any:   # a fake kernel stricter than the real one
        raise RuntimeError("a fake kernel that refuses")

    monkeypatch.setattr(sizing, "fake_step", stricter)
    est = dk.estimate_memory(model, torch.randn(64, 8))
    assert est.peak > 0 and "real CPU steps" in est.method
    monkeypatch.setattr(sizing, "fake_step", fake_step)


class _Retrieval(nn.Module):
    """Scores a batch of queries against a bank of fixed size, passed beside the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
        return self.q(x) @ bank.T


def test_a_tensor_without_the_batch_dimension_keeps_its_shape_when_the_batch_changes() -> None:
    """batch_size= resized every tensor: a 5,000-row bank beside 16 queries became 256 rows (-96 %)."""
    torch.manual_seed(0)
    model, bank = _Retrieval(), torch.randn(5000, 64)
    est = dk.estimate_memory(model, (torch.randn(16, 64), bank), batch_size=256)
    truth = measured_peak(model, (torch.randn(256, 64), bank), loss_fn=cross_entropy_loss)
    assert abs(est.peak / truth - 1) <= 0.02, (est.peak, truth)
    assert est.at_batch_size(256).peak == est.peak


class _Sorted(nn.Module):
    """Keeps each row's tokens up to its mask: shapes follow the mask's values."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ff = nn.Embedding(100, 32), nn.Linear(32, 10)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.ff(self.emb(tokens)[mask]).sum(0, keepdim=True).expand(tokens.shape[0], -1)


def test_rows_that_stand_in_are_spread_over_a_sorted_batch() -> None:
    """A batch sorted by length has its short rows first: the first rows alone read 38 % low."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 100, (256, 64))
    mask = torch.arange(64)[None, :] < (torch.arange(256) // 4 + 1)[:, None]    # row i keeps i // 4 + 1
    est = dk.estimate_memory(_Sorted(), (tokens, mask))
    truth = measured_peak(_Sorted(), (tokens, mask), loss_fn=cross_entropy_loss)
    assert "extrapolated" in est.method and abs(est.peak / truth - 1) <= 0.10, (est.peak, truth)


class _Coin(nn.Module):
    """Runs each block when a one-number coin with probability ``p`` comes up 1."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.p = p
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if torch.bernoulli(torch.tensor(self.p)):
                x = x + block(x).relu()
        return x


def test_a_one_number_coin_is_sized_with_every_layer_running() -> None:
    """torch.bernoulli(p) fell back to real steps, which drew at random (-67 %)."""
    x = torch.randn(64, 64)
    torch.manual_seed(0)
    est = dk.estimate_memory(_Coin(), x)
    torch.manual_seed(0)
    every = measured_peak(_Coin(p=1.0), x, loss_fn=cross_entropy_loss)
    assert est.peak == every and "one-number random draw" in est.method


def test_an_extrapolation_never_falls_below_the_larger_batch_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two real steps that differ by more than their batch (random skips) sloped down to 0 B."""
    parts = dict.fromkeys(("weights", "gradients", "optimizer state", "inputs", "activations", "temporaries"), 0)

    def falling(*_: Any, batches: tuple[int, ...], **__: Any) -> Any:
        return [{"backward": (1000 if b == batches[-1] else 600, dict(parts, activations=600))} for b in batches]

    monkeypatch.setattr(sizing, "fake_step", lambda *a, **k: (_ for _ in ()).throw(
        torch._subclasses.fake_tensor.DynamicOutputShapeException(torch.ops.aten.nonzero.default)))
    monkeypatch.setattr(sizing, "real_peaks", falling)
    est = dk.estimate_memory(nn.Linear(4, 4), torch.randn(64, 4))
    assert est.peak >= 600


class _SkipCoin(_Coin):
    """The other convention: skip the block when the coin comes up 1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if torch.bernoulli(torch.tensor(self.p)):
                continue
            x = x + block(x).relu()
        return x


def test_a_convention_that_skips_every_layer_one_way_is_sized_the_other() -> None:
    """Drawn one way every block is skipped and nothing is left to train: the other way sizes it."""
    x = torch.randn(64, 64)
    torch.manual_seed(0)
    est = dk.estimate_memory(_SkipCoin(), x)
    torch.manual_seed(0)
    assert est.peak == measured_peak(_Coin(p=1.0), x, loss_fn=cross_entropy_loss)   # every block runs
