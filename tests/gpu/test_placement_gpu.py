"""Placement on a real CUDA GPU: async copies, prefetch overlap, precision, no-sync metrics."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import devicekit as dk

pytestmark = pytest.mark.gpu

LONG_SLEEP = int(2e9)  # GPU clock cycles of torch.cuda._sleep: about a second on current GPUs


@pytest.fixture
def cuda() -> torch.device:
    device = torch.device("cuda", torch.cuda.current_device())
    # Fill the caching allocator first, so that no cudaMalloc (which may synchronise) runs
    # while a test keeps the GPU busy on purpose.
    warm = [torch.empty(1 << 22, device=device) for _ in range(8)]
    warm += [torch.empty(1, device=device) for _ in range(64)]
    del warm
    torch.cuda.synchronize()
    return device


def test_pinned_copy_is_asynchronous_and_correct(cuda: torch.device) -> None:
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    torch.cuda._sleep(LONG_SLEEP)  # the stream is busy: a blocking copy would wait for it
    moved = dk.to_device({"x": host}, cuda)["x"]  # non_blocking=None: async from pinned memory
    assert not torch.cuda.current_stream().query()  # returned while the GPU is still busy
    torch.cuda.synchronize()
    assert moved.device == cuda and torch.equal(moved.cpu(), host)


def test_pageable_copy_leaves_the_source_free_at_once(cuda: torch.device) -> None:
    """non_blocking=None copies pageable memory asynchronously too (issue 38: no per-tensor
    is_pinned()): CUDA stages it before the call returns, so the host may overwrite it then."""
    host = torch.arange(1 << 16, dtype=torch.float32)
    expected = host.clone()
    torch.cuda._sleep(LONG_SLEEP // 4)  # the stream is busy: the copy itself runs after it
    moved = dk.to_device([host, host], cuda)
    host.fill_(-1.0)
    assert moved[0] is moved[1]
    assert torch.equal(moved[0].cpu(), expected)


def test_to_device_back_to_host_and_device_of(cuda: torch.device) -> None:
    model = nn.Linear(4, 4)
    batch = {"model": model, "x": torch.ones(3, 4)}
    out = dk.to_device(batch, cuda)
    assert out["model"] is model and dk.device_of(model) == cuda and dk.device_of(out) == cuda
    back = dk.to_device(out, "cpu")
    assert back["x"].device.type == "cpu" and torch.equal(back["x"], torch.ones(3, 4))
    split = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to(cuda))
    with pytest.raises(dk.PlacementError, match="cpu, cuda"):
        dk.device_of(split)


def test_pin_memory_pins_host_tensors(cuda: torch.device) -> None:
    out = dk.pin_memory({"x": torch.ones(4), "y": [torch.zeros(2)]})
    assert out["x"].is_pinned() and out["y"][0].is_pinned()


def make_batches(n: int, numel: int) -> list[dict[str, torch.Tensor]]:
    return [{"x": torch.full((numel,), float(i)).pin_memory(), "i": torch.tensor(i)} for i in range(n)]


def test_prefetcher_stays_correct_under_load(cuda: torch.device) -> None:
    batches = make_batches(12, 1 << 22)  # 16 MiB each
    checks, indices = [], []
    for i, batch in enumerate(dk.Prefetcher(batches, cuda)):
        assert batch["x"].device == cuda
        torch.cuda._sleep(int(1e6))  # compute keeps the stream busy while copies run
        checks.append((batch["x"] == float(i)).all())  # read right away: must see the full copy
        indices.append(batch["i"])
    torch.cuda.synchronize()
    assert all(c.item() for c in checks)
    assert [t.item() for t in indices] == list(range(12))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs")
def test_prefetcher_waits_for_a_loader_writing_on_another_gpu(cuda: torch.device) -> None:
    other = torch.device("cuda", 1)

    def cuda_loader():
        for i in range(3):
            with torch.cuda.device(other):
                torch.cuda._sleep(LONG_SLEEP)  # the loader's stream is busy ...
                yield {"x": torch.full((1 << 20,), float(i), device=other)}  # ... then writes

    checks = [(batch["x"] == float(i)).all() for i, batch in
              enumerate(dk.Prefetcher(cuda_loader(), cuda))]
    torch.cuda.synchronize()
    assert all(c.item() for c in checks)


def test_prefetcher_copies_overlap_compute(cuda: torch.device) -> None:
    batches = make_batches(3, 1 << 20)
    prefetcher = dk.Prefetcher(batches, cuda)
    produced = []

    def source():  # records how far the loader has been read
        for i, batch in enumerate(batches):
            produced.append(i)
            yield batch

    prefetcher.iterable = source()
    for i, _batch in enumerate(prefetcher):
        assert produced[-1] == min(i + 1, 2)  # the next batch was already taken and sent
        torch.cuda._sleep(LONG_SLEEP)  # "compute" on this batch
        if i == 1:
            # batch 2 was copied after batch 0's compute was queued; its copy finishes while
            # the compute stream is still busy: the copy did not wait for compute.
            assert prefetcher.stream is not None
            prefetcher.stream.synchronize()
            assert not torch.cuda.current_stream().query()
    torch.cuda.synchronize()


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(10, 5)
        self.bn = nn.BatchNorm1d(5)
        self.l2 = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.bn(self.l1(x)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_batchnorm_network_runs_on_gpu(cuda: torch.device, dtype: torch.dtype) -> None:
    model = dk.half(dk.to_device(BNNet(), cuda), dtype=dtype)
    assert model.bn.weight.dtype == torch.float32 and model.l1.weight.dtype == dtype
    out = model(torch.randn(8, 10, device=cuda))
    assert out.dtype == dtype and torch.isfinite(out.float()).all()
    out.float().sum().backward()
    assert model.bn.weight.grad is not None
    model.eval()
    assert model(torch.randn(1, 10, device=cuda)).dtype == dtype  # the seeds' single-sample case


def test_mixed_precision_trains_a_batchnorm_network(cuda: torch.device) -> None:
    for forced in (None, torch.float16):
        amp = dk.mixed_precision(cuda, dtype=forced)
        expected = torch.bfloat16 if forced is None and torch.cuda.is_bf16_supported() else torch.float16
        assert amp.dtype == expected and amp.uses_scaler == (expected == torch.float16)
        model = dk.to_device(BNNet(), cuda)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):
            with amp.autocast():
                loss = model(torch.randn(16, 10, device=cuda)).float().pow(2).mean()
            optimizer.zero_grad()
            amp.backward_step(loss, optimizer)
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_sync_guard_catches_item_in_a_loop(cuda: torch.device) -> None:
    x = torch.randn(100, 100, device=cuda)
    total = 0.0
    with dk.sync_guard() as report:
        for _ in range(5):
            total += (x @ x).norm().item()
    assert report.checked and report.count >= 5
    assert any(s.filename == __file__ and ".item()" in s.line for s in report.syncs)
    assert torch.cuda.get_sync_debug_mode() == 0


def test_sync_guard_error_mode_raises_at_the_sync(cuda: torch.device) -> None:
    x = torch.ones(3, device=cuda)
    with pytest.raises(RuntimeError, match="synchronizing"):
        with dk.sync_guard(mode="error") as report:
            x.sum().item()
    assert report.raised and report.count == 1
    assert torch.cuda.get_sync_debug_mode() == 0


def test_on_device_metrics_never_sync(cuda: torch.device) -> None:
    x = torch.randn(64, 64, device=cuda)
    mean, log = dk.RunningMean(), dk.MetricLog()
    with dk.sync_guard(mode="error") as report:  # any host sync would raise here
        for _ in range(200):
            norm = torch.linalg.matrix_norm(x @ x)
            mean.update(norm)
            log.append(norm=norm, lr=0.1)
        result = mean.compute()
    assert report.count == 0 and result.device == cuda
    values = log["norm"]
    assert len(values) == 200 and mean.value == pytest.approx(sum(values) / 200, rel=1e-5)


def test_checkpoint_loads_onto_the_current_device(cuda: torch.device, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "gpu.pt"
    dk.save_checkpoint({"w": torch.ones(3, device=cuda)}, path)
    assert dk.load_checkpoint(path)["w"].device == cuda
    assert dk.load_checkpoint(path, map_location="cpu")["w"].device.type == "cpu"


def test_modes_run_a_conv_and_deterministic_mode_repeats_it(cuda: torch.device) -> None:
    conv = nn.Conv2d(3, 8, 3).to(cuda)
    x = torch.randn(4, 3, 32, 32, device=cuda)
    with dk.performance_mode():
        assert torch.backends.cudnn.benchmark
        assert torch.isfinite(conv(x)).all()
    with dk.deterministic_mode():
        first = conv(x)
        again = conv(x)
        assert torch.equal(first, again)
    assert not torch.backends.cudnn.deterministic


def test_running_mean_refuses_a_second_device(cuda: torch.device) -> None:
    mean = dk.RunningMean()
    mean.update(torch.ones((), device=cuda))
    with pytest.raises(dk.InvalidValueError, match="meta"):
        mean.update(torch.ones((), device="meta"))
    assert mean.value == 1.0
