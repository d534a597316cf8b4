"""Model parallelism on a real GPU: a split over cuda:0 and cpu trains; a pipeline matches."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import devicekit as dk
from tests.modelparallel.modelpar_models import (
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


class Slow(nn.Module):
    """Many dependent GPU matmuls, then the result: a copy that does not wait for it reads garbage."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.eye(x.shape[1], device=x.device) * 1.0001
        y = x
        for _ in range(200):
            y = y @ w
        return y


@pytest.mark.parametrize("devices", [["cuda:0", "cpu"], ["cpu", "cuda:0"], ["cuda:0", "cuda:0"]])
def test_pipeline_between_cuda_and_cpu_matches_reference(devices: list[str]) -> None:
    x = sample_for("mlp")
    ref, want = reference_run(MODELS["mlp"], x)
    with dk.Pipeline(MODELS["mlp"](), devices, chunks=4, sample=x) as pipe:
        out = pipe(x)
        assert out.device == torch.device(devices[-1])
        torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=1e-3)
        loss_of(out).backward()
        assert_same_grads(pipe.module, ref, atol=1e-4)


def test_copies_wait_for_the_producing_stream() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 512, device="cuda:0")
    model = nn.Sequential(Slow(), nn.Identity())
    want = Slow()(x).cpu()
    side = torch.cuda.Stream("cuda:0")
    with dk.Pipeline(model, ["cuda:0", "cpu"], chunks=8, balance=[1, 1]) as pipe, torch.no_grad():
        for _ in range(3):
            with torch.cuda.stream(side):  # the caller works on its own stream
                got = pipe(x)
            torch.testing.assert_close(got, want)


def test_copy_streams_are_side_streams_and_ordered() -> None:
    from devicekit.modelparallel.copy_streams import CopyStreams, mark

    device = torch.device("cuda:0")
    streams = CopyStreams()
    x = torch.randn(256, 256, device=device)
    y = Slow()(x)  # queued on the default stream
    back = streams.receive(y, torch.device("cpu"), mark(y))  # copied on the side stream
    assert streams.stream(device) != torch.cuda.default_stream(device)
    torch.testing.assert_close(back, y.cpu())
    host = torch.randn(128, 128)
    on_gpu = streams.receive(host, device, ())
    assert on_gpu.device == device and set(streams.streams) == {device}
    torch.testing.assert_close((on_gpu * 2).cpu(), host * 2)  # the compute stream waited for the copy


def test_copy_stream_between_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    from devicekit.modelparallel.copy_streams import CopyStreams, mark

    streams = CopyStreams()
    x = torch.randn(256, 256, device="cuda:0")
    y = Slow()(x)
    with torch.cuda.device(1):
        moved = streams.receive(y, torch.device("cuda:1"), mark(y))
        out = moved * 1.0
    assert set(streams.streams) == {torch.device("cuda:0"), torch.device("cuda:1")}
    torch.testing.assert_close(out.cpu(), y.cpu())
    x = sample_for("mlp")
    with dk.Pipeline(nn.Sequential(Slow(), *MODELS["mlp"]()), ["cuda:0", "cuda:1"], chunks=4,
                     balance=[1, 7]) as pipe, torch.no_grad():
        got = pipe(x)
    assert got.device == torch.device("cuda:1")


def test_functional_dropout_on_two_stages_of_one_gpu_replays_its_masks() -> None:
    """Issue 9 item 3d on a GPU: two stages on cuda:0 share its generator; F.dropout in a custom
    layer must get the gradients of the masks its forward drew."""
    from tests.modelparallel.test_no_silent_results import check_functional_dropout

    check_functional_dropout(["cuda:0", "cuda:0"], "except_last")


def test_traced_resnet_pipelined_over_cuda_and_cpu_matches_unsplit() -> None:
    """A non-Sequential model (skips, BatchNorm in eval) as a chain over cuda:0 and cpu."""
    from tests.modelparallel.any_models import ANY_MODELS, any_sample, twin
    from tests.modelparallel.any_models import loss_of as any_loss

    model, ref = twin(ANY_MODELS["resnet"])
    x = any_sample("resnet")
    pipe = dk.Pipeline(model, ["cuda:0", "cpu"], chunks=4, sample=x)
    pipe.eval()
    ref.eval()
    out, want = pipe(x), ref(x)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-3)
    any_loss(out).backward()
    any_loss(want).backward()
    for got, expected in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got.grad.cpu(), expected.grad, atol=1e-4, rtol=1e-3)
    pipe.close()
