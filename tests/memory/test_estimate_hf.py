"""The estimate on Hugging Face transformers models (tests/memory/hf_zoo.py: tiny configs,
random weights) against the live-storage truth of the same loop: the default loop (``out =
model(x)``, cross-entropy, the previous output gone once the next forward returns) and the
HF-style step (``model(**batch, labels=...).loss.backward()``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit.memory.losses import cross_entropy_loss
from devicekit.memory.step import LoopOutput
from tests.memory.memory_truth import measured_peak

transformers = pytest.importorskip("transformers")

from tests.memory.hf_zoo import HF_ZOO, hf_step  # noqa: E402

#: the issue's goal: within 10 % of the truth, never under it by more than 5 %
TOLERANCE, UNDER = 0.10, 0.05


@pytest.mark.parametrize("name", sorted(HF_ZOO))
def test_default_loop_within_goal_on_hf_models(name: str) -> None:
    case = HF_ZOO[name]
    model, batch = case.build(), case.sample(case.batch)
    est = dk.estimate_memory(model, batch, device="cpu")        # nothing said: the default loop
    truth = measured_peak(model, batch, loss_fn=cross_entropy_loss)
    error = est.peak / truth - 1
    assert -UNDER <= error <= TOLERANCE, (name, est.peak, truth, f"{error:+.3f}", est.method)


@pytest.mark.parametrize("name", ["gpt2", "vit", "t5"])
def test_hf_style_step_under_bf16_autocast_within_goal(name: str) -> None:
    """precision= with a step=: the estimate runs the step under autocast, and so does the truth
    (it ran the step in fp32 and read GPT-2 -10.8 %, ViT -11.2 % where the estimate was exact)."""
    case = HF_ZOO[name]
    model, batch = case.build(), case.sample(case.batch)
    step = hf_step(case)
    est = dk.estimate_memory(model, batch, step=step, precision="bf16", device="cpu")
    truth = measured_peak(model, batch, step=step, precision="bf16")
    error = est.peak / truth - 1
    assert -UNDER <= error <= TOLERANCE, (name, est.peak, truth, f"{error:+.3f}", est.method)


@pytest.mark.parametrize("name", sorted(HF_ZOO))
def test_hf_style_step_within_goal(name: str) -> None:
    case = HF_ZOO[name]
    model, batch = case.build(), case.sample(case.batch)
    step = hf_step(case)                                        # returns `out`: kept by the loop
    est = dk.estimate_memory(model, batch, step=step, device="cpu")
    truth = measured_peak(model, batch, step=step)
    error = est.peak / truth - 1
    assert -UNDER <= error <= TOLERANCE, (name, est.peak, truth, f"{error:+.3f}", est.method)


def test_the_previous_output_is_gone_once_the_next_forward_returns() -> None:
    model = torch.nn.Linear(4, 4)
    with LoopOutput(model) as last:
        first = model(torch.zeros(2, 4))
        last.keep(first)
        seen = last.value
        del first
        assert seen is last.value
        del seen
        model(torch.zeros(2, 4))                                # the next forward: `out` rebound
        assert last.value is None


def test_mixtral_with_grouped_experts_runs_on_fake_tensors() -> None:
    """transformers' default experts call ``_grouped_mm``, whose meta kernel accepts only bf16
    while the CPU kernel multiplies fp32: the CPU op is sized from its shapes, so the model runs
    on fake tensors (no real steps, no extrapolation)."""
    case = HF_ZOO["mixtral"]
    est = dk.estimate_memory(case.build(), case.sample(case.batch), device="cpu")
    assert est.method.startswith("fake tensors"), est.method


def test_a_fake_kernel_stricter_than_the_real_one_falls_back_to_real_steps(monkeypatch) -> None:
    """Any fake-kernel failure (here: _grouped_mm's bf16-only meta kernel, without devicekit's
    stand-in) falls back to real CPU steps and says why, never blaming the sample."""
    from devicekit.memory import real_kernels

    monkeypatch.delitem(real_kernels._MISSING, "aten::_grouped_mm")
    case = HF_ZOO["mixtral"]
    model, batch = case.build(), case.sample(case.batch)
    est = dk.estimate_memory(model, batch, device="cpu")
    assert est.method.startswith("real CPU steps") and "fake tensors cannot run it" in est.method
    assert "BF16" in est.method and "sample" not in est.method
    truth = measured_peak(model, batch, loss_fn=cross_entropy_loss)
    assert -UNDER <= est.peak / truth - 1 <= TOLERANCE, (est.peak, truth)


def test_layerdrop_is_sized_with_every_layer_running() -> None:
    """LayerDrop skips a layer when ``torch.rand([])`` falls below its rate: the estimate sizes
    the step in which none is skipped (so does the truth), whatever the random numbers of the
    real steps that stand in for fake tensors here."""
    case = HF_ZOO["wav2vec2-ctc"]
    model, batch = case.build(), case.sample(8)
    model.config.layerdrop = 0.99                              # nearly every layer skipped
    est = dk.estimate_memory(model, batch, step=hf_step(case), device="cpu")
    truth = measured_peak(model, batch, step=hf_step(case))
    assert -UNDER <= est.peak / truth - 1 <= TOLERANCE, (est.peak, truth)


def test_a_sample_the_model_really_rejects_is_refused_with_the_real_error() -> None:
    from devicekit.errors import InvalidValueError

    model = torch.nn.Sequential(torch.nn.Linear(16, 4))
    with pytest.raises(InvalidValueError, match=r"failed on the sample \[\(8, 7\)\]: RuntimeError"):
        dk.estimate_memory(model, torch.zeros(8, 7), device="cpu")


def test_a_step_that_cannot_be_resized_is_said_so_not_blamed_on_the_sample(monkeypatch) -> None:
    """Real CPU steps stand in at smaller batches; a step= holding full-batch labels breaks
    there, and the refusal says so instead of calling the sample wrong."""
    from devicekit.errors import InvalidValueError

    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    labels = torch.zeros(512, dtype=torch.long)      # above 128: real steps stand in at 64 and 128

    def step(m: torch.nn.Module, x: torch.Tensor) -> Any:
        out = m(x)
        torch.nn.functional.cross_entropy(out, labels).backward()
        return out

    def no_fake(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a fake kernel that refuses")

    import devicekit.memory.sizing as estimate_module

    monkeypatch.setattr(estimate_module, "fake_step", no_fake)
    with pytest.raises(InvalidValueError, match="take them from its sample"):
        dk.estimate_memory(model, torch.zeros(512, 8), step=step, device="cpu")
