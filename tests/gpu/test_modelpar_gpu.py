"""Model parallelism on a real GPU: a split over cuda:0 and cpu trains; a pipeline matches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import devicekit as dk
from tests.parallel.modelpar_models import (
    MODELS,
    assert_same_grads,
    loss_of,
    reference_run,
    sample_for,
)

pytestmark = pytest.mark.gpu


def test_split_over_cuda_and_cpu_trains() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    x = torch.randn(256, 32)
    y = x[:, :1] * 2 - x[:, 1:2]
    split = dk.split(model, ["cuda:0", "cpu"], sample=x)
    assert split.parts[0][0].weight.device.type == "cuda"
    assert split.parts[-1][-1].weight.device.type == "cpu"
    opt = torch.optim.Adam(split.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        out = split(x)  # input moves to cuda:0, output comes back on cpu
        assert out.device.type == "cpu"
        loss = nn.functional.mse_loss(out, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_pipeline_on_one_gpu_matches_reference(name: str) -> None:
    x = sample_for(name)
    ref, want = reference_run(MODELS[name], x)
    pipe = dk.Pipeline(MODELS[name](), ["cuda:0", "cuda:0"], chunks=4, sample=x)
    out = pipe(x)
    assert out.device == torch.device("cuda:0")
    torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=1e-3)
    loss_of(out).backward()
    assert_same_grads(pipe.module, ref, atol=1e-4)


def test_pipeline_across_gpus_when_there_are_two() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    x = sample_for("mlp")
    ref, want = reference_run(MODELS["mlp"], x)
    pipe = dk.Pipeline(MODELS["mlp"](), ["cuda:0", "cuda:1"], chunks=4)
    out = pipe(x)
    assert out.device == torch.device("cuda:1")
    loss_of(out).backward()
    assert_same_grads(pipe.module, ref, atol=1e-4)
