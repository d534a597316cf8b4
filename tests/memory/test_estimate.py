"""dk.estimate_memory against torch's own MemTracker on CPU, parts, batch scaling, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit.errors import InvalidValueError
from devicekit.memory.step import make_optimizer, training_step
from tests.memory.estimate_models import MODELS, CheckpointedMLP, TiedLM, measured_peak_cpu

#: the issue's goal (measured on CPU: every case within 2 %)
TOLERANCE = 0.10


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("batch", [8, 32])
def test_estimate_within_ten_percent_of_memtracker(name: str, batch: int) -> None:
    build, make_sample = MODELS[name]
    torch.manual_seed(0)
    model, sample = build(), make_sample(batch)
    est = dk.estimate_memory(model, sample, device="cpu")
    truth = measured_peak_cpu(model, sample)
    assert abs(est.peak - truth) <= TOLERANCE * truth, (name, batch, est.peak, truth)
    assert sum(est.parts.values()) == est.peak
    assert est.batch_size == batch


def test_parts_name_what_they_hold() -> None:
    model = MODELS["mlp"][0]()
    weights = sum(p.numel() * 4 for p in model.parameters())
    est = dk.estimate_memory(model, torch.empty(16, 512, device="meta"), device="cpu")
    assert est.peak_phase == "optimizer step"       # adam's step peaks above the backward here
    assert est.parts["weights"] == weights
    assert est.parts["gradients"] == weights
    assert est.parts["optimizer state"] == 2 * weights + 4 * len(list(model.parameters()))  # + step counters
    text = str(est)
    assert "optimizer state" in text and "peak" in text and "adam" in text


def test_tied_weights_are_counted_once() -> None:
    model = TiedLM()
    est = dk.estimate_memory(model, torch.zeros(4, 32, dtype=torch.long), device="cpu")
    unique = sum(p.numel() * 4 for p in model.parameters())       # parameters() dedupes ties
    assert est.parts["weights"] == unique


def test_meta_model_is_sized_without_memory() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)])   # 0.5 GiB of fp32 weights
    est = dk.estimate_memory(model, torch.empty(4, 4096, device="meta"), device="cpu")
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert est.parts["weights"] == weights and est.peak > 4 * weights


def test_optimizer_and_inference_change_the_answer() -> None:
    model, sample = MODELS["mlp"][0](), torch.empty(16, 512)
    adam = dk.estimate_memory(model, sample, device="cpu")
    sgd = dk.estimate_memory(model, sample, optimizer="sgd", device="cpu")
    infer = dk.estimate_memory(model, sample, training=False, device="cpu")
    assert sgd.parts["optimizer state"] == 0 < adam.parts["optimizer state"]
    assert infer.peak < sgd.peak < adam.peak
    assert infer.parts["gradients"] == 0


def test_activation_checkpointing_is_seen_and_accurate() -> None:
    sample = torch.randn(256, 512)
    plain = dk.estimate_memory(CheckpointedMLP(use_checkpoint=False), sample, optimizer="sgd", device="cpu")
    model = CheckpointedMLP()
    ckpt = dk.estimate_memory(model, sample, optimizer="sgd", device="cpu")
    assert ckpt.parts["activations"] < plain.parts["activations"]
    truth = measured_peak_cpu(model, sample, optimizer="sgd")
    assert abs(ckpt.peak - truth) <= TOLERANCE * truth


def test_mixed_precision_bf16_and_half_model() -> None:
    model, sample = MODELS["transformer"][0](), torch.randn(8, 64, 128)
    fp32 = dk.estimate_memory(model, sample, device="cpu")
    bf16 = dk.estimate_memory(model, sample, precision="bf16", device="cpu")
    assert bf16.parts["activations"] != fp32.parts["activations"]
    truth = measured_peak_cpu(model, sample, precision="bf16")
    assert abs(bf16.peak - truth) <= TOLERANCE * truth
    halved = dk.half(MODELS["mlp"][0](), dtype=torch.bfloat16)
    est = dk.estimate_memory(halved, torch.randn(8, 512), device="cpu")
    assert est.parts["weights"] == sum(p.numel() * 2 for p in halved.parameters())


def test_batch_size_argument_and_max_batch_size_match_find_batch_size() -> None:
    build, make_sample = MODELS["cnn-batchnorm"]
    model = build()
    est = dk.estimate_memory(model, make_sample(4), batch_size=8, device="cpu")
    assert est.batch_size == 8
    budget = 24 * 2**20

    def trial(n: int) -> None:          # a real step that "runs out of memory" above the budget
        if measured_peak_cpu(model, make_sample(n)) > budget:
            raise torch.OutOfMemoryError("synthetic budget exceeded")

    found = dk.find_batch_size(trial, start=8, maximum=256)
    predicted = est.max_batch_size(budget)
    assert abs(predicted - found) <= 1, (predicted, found)
    assert est.max_batch_size(1024) == 0          # not even one sample fits in 1 KiB


def test_estimate_leaves_the_model_untouched() -> None:
    model = MODELS["cnn-batchnorm"][0]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dk.estimate_memory(model, torch.randn(4, 3, 32, 32), device="cpu")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    opt = make_optimizer("adam", model.parameters())
    training_step(model, torch.randn(4, 3, 32, 32), opt)           # still trains for real


@pytest.mark.parametrize("kwargs, words", [
    ({"optimizer": "adamax2"}, "adamax2"),
    ({"precision": "fp8"}, "fp8"),
    ({"batch_size": 0}, "batch_size 0"),
    ({"device": "cuda"} if not torch.cuda.is_available() else {"batch_size": -1}, "cuda" if not torch.cuda.is_available() else "-1"),
])
def test_bad_arguments_are_one_line_errors(kwargs: dict, words: str) -> None:
    with pytest.raises(InvalidValueError, match=words) as info:
        dk.estimate_memory(MODELS["mlp"][0](), torch.empty(2, 512), **kwargs)
    assert "\n" not in str(info.value)


def test_a_sample_that_does_not_fit_the_model_names_the_shape() -> None:
    with pytest.raises(InvalidValueError, match=r"\(2, 7\)"):
        dk.estimate_memory(MODELS["mlp"][0](), torch.empty(2, 7), device="cpu")
    with pytest.raises(InvalidValueError, match="no tensor"):
        dk.estimate_memory(MODELS["mlp"][0](), "not a batch", device="cpu")


def test_a_device_other_than_cpu_or_cuda_is_refused_in_one_line() -> None:
    model = torch.nn.Linear(4, 4)
    for bad, named in (("mps", "'mps'"), ("xpu", "'xpu'"), ("meta", "'meta'"), ("tpu", "'tpu'"), (3.5, "3.5")):
        with pytest.raises(InvalidValueError, match=named) as info:
            dk.estimate_memory(model, torch.empty(2, 4), device=bad)
        assert "\n" not in str(info.value)


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, decoder_x: torch.Tensor) -> torch.Tensor:
        return self.dec(decoder_x) + self.enc(x)


def test_a_model_that_wants_more_than_the_sample_is_pointed_to_step() -> None:
    with pytest.raises(InvalidValueError, match="decoder_x.*takes your step: step= / --step") as info:
        dk.estimate_memory(_TwoInputs(), torch.empty(4, 8), device="cpu")
    assert "\n" not in str(info.value)

    def step(model: nn.Module, x: torch.Tensor) -> None:
        model(x, x).sum().backward()

    assert dk.estimate_memory(_TwoInputs(), torch.empty(4, 8), step=step, device="cpu").peak > 0
