"""The leak finder on real models: a ResNet and a GPT with tied embeddings, Adam, a few steps.

A clean training loop is silent (Adam's state, BatchNorm's running statistics and the tied
weight are warm-up or shared, not leaks); a forward hook registered on a deep block every step
is named with its holder and line, from the step function and from a hand-written loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import devicekit as dk
from tests.modelparallel.any_models import ANY_MODELS, any_sample, loss_of

SOURCE = Path(__file__).read_text().splitlines()
DEEP_BLOCK = {"resnet": ("layer2", 1), "gpt": ("blocks", 2)}


def line_of(marker: str) -> int:
    hits = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def setup(name: str) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = ANY_MODELS[name]()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), any_sample(name)


@pytest.mark.parametrize("name", ["resnet", "gpt"])
def test_clean_training_of_a_real_model_is_silent(name: str) -> None:
    model, opt, sample = setup(name)
    losses: list[float] = []

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model(sample))
        loss.backward()
        opt.step()
        losses.append(loss.item())

    report = dk.find_leaks(step, steps=6, warmup=2)
    assert report.ok and not report.minor, str(report)
    assert not [note for note in report.notes if "no holder found" in note], str(report)


@pytest.mark.parametrize("name", ["resnet", "gpt"])
def test_hook_per_step_on_a_deep_block_is_named(name: str) -> None:
    model, opt, sample = setup(name)
    attr, index = DEEP_BLOCK[name]
    block = getattr(model, attr)[index]

    def step() -> None:
        kept: list[torch.Tensor] = []
        block.register_forward_hook(lambda m, i, o: kept.append(o))  # LEAK-deep-hook
        opt.zero_grad(set_to_none=True)
        loss_of(model(sample)).backward()
        opt.step()

    report = dk.find_leaks(step, steps=6, warmup=2)
    leak = report.leaks[0]
    assert leak.holder == "block._forward_hooks", str(report)  # the name the step uses
    assert leak.kind == "hook_per_step"
    assert (leak.filename, leak.lineno) == (__file__, line_of("LEAK-deep-hook"))
    assert len(report.leaks) == 1, str(report)


def test_hand_written_loop_on_gpt_names_the_hook_under_the_model() -> None:
    model, opt, sample = setup("gpt")
    with dk.LeakDetector() as ld:
        for _ in range(6):
            kept: list[torch.Tensor] = []
            hook = lambda m, i, o, kept=kept: kept.append(o)  # noqa: E731
            model.blocks[2].register_forward_hook(hook)  # LEAK-gpt-loop-hook
            opt.zero_grad(set_to_none=True)
            loss_of(model(sample)).backward()
            opt.step()
            ld.step()
    report = ld.report()
    leak = report.leaks[0]
    assert (leak.holder, leak.kind) == ("model.blocks.2._forward_hooks", "hook_per_step"), str(report)
    assert leak.lineno == line_of("LEAK-gpt-loop-hook")
    assert leak.bytes_per_step >= 8 * 12 * 32 * 4  # one block output (batch 8, 12 tokens, dim 32)
