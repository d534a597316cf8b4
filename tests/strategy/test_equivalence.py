"""check_equivalence: a correct DDP set-up passes; known mistakes get their diagnosis."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import devicekit as dk

TIMEOUT = 60.0


def build() -> nn.Module:  # module level: check_equivalence sends it to the gloo ranks
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(n, 6, generator=gen), torch.randn(n, 2, generator=gen)


# A correct DDP set-up passing is checked inside a running job in test_ddp.py (its ranks are
# already started there); here the spawning path runs once, on the sum-reduction mistake.


def test_sum_reduction_is_diagnosed_with_the_world_size_factor() -> None:
    with pytest.raises(dk.GradientMismatchError, match="sum vs mean reduction") as caught:
        dk.check_equivalence(build, _batch(), nn.MSELoss(reduction="sum"), world_size=2,
                             timeout=TIMEOUT)
    report = caught.value.report
    assert not report.passed and report.parallel == "DDP" and report.world_size == 2
    assert [p.name for p in report.parameters] == [n for n, _ in build().named_parameters()]
    assert all(not p.passed for p in report.parameters)
    assert report.ratio == pytest.approx(0.5, rel=1e-4)    # DDP averaged per-shard sums
    assert "reduction='sum'" in report.diagnosis
    assert "\n" not in str(caught.value.args[0])            # one-line message


def summing_all_reduce(model: nn.Module, batch: Any, loss_fn: Any) -> dict[str, torch.Tensor]:
    """A hand-rolled 'parallel' step that sums shard gradients instead of averaging them."""
    x, y = batch
    total: dict[str, torch.Tensor] = {}
    for xs, ys in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
        model.zero_grad()
        loss_fn(model(xs), ys).backward()
        for name, p in model.named_parameters():
            total[name] = total.get(name, 0) + p.grad.clone()
    return total


def same_shard_everywhere(model: nn.Module, batch: Any, loss_fn: Any) -> None:
    """Both 'ranks' trained on the first half: the averaged gradient is shard 0's."""
    x, y = batch
    model.zero_grad()
    loss_fn(model(x[:4]), y[:4]).backward()


def averaged_correctly(model: nn.Module, batch: Any, loss_fn: Any) -> None:
    x, y = batch
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for xs, ys in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
        model.zero_grad()
        loss_fn(model(xs), ys).backward()
        for g, p in zip(grads, model.parameters(), strict=True):
            g += p.grad / 2
    for g, p in zip(grads, model.parameters(), strict=True):
        p.grad = g


def test_callable_that_averages_passes() -> None:
    assert dk.check_equivalence(build, _batch(), nn.MSELoss(), parallel=averaged_correctly).passed


def test_summed_gradients_are_diagnosed() -> None:
    report = dk.check_equivalence(build, _batch(), nn.MSELoss(), parallel=summing_all_reduce,
                                  raise_on_mismatch=False)
    assert not report.passed
    assert report.diagnosis.startswith("sum vs mean reduction")
    assert "world_size=2 times" in report.diagnosis
    assert report.ratio == pytest.approx(2.0, rel=1e-4)


def test_duplicated_shards_are_diagnosed() -> None:
    report = dk.check_equivalence(build, _batch(), nn.MSELoss(), parallel=same_shard_everywhere,
                                  raise_on_mismatch=False)
    assert not report.passed
    assert "shard 0" in report.diagnosis and "distributed_sampler" in report.diagnosis
    assert "FAIL" in str(report)


def bn_build() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def test_batchnorm_is_diagnosed() -> None:
    report = dk.check_equivalence(bn_build, _batch(), nn.MSELoss(), parallel=averaged_correctly,
                                  raise_on_mismatch=False)
    assert not report.passed and "SyncBatchNorm" in report.diagnosis


def test_balanced_data_parallel_on_cpu_is_equivalent() -> None:
    report = dk.check_equivalence(build, _batch(), nn.MSELoss(), parallel="balanced")
    assert report.passed and report.parallel == "BalancedDataParallel"


def test_bad_input_is_named() -> None:
    with pytest.raises(dk.InvalidValueError, match="does not divide by world_size=3"):
        dk.check_equivalence(build, _batch(8), nn.MSELoss(), world_size=3)
    with pytest.raises(dk.InvalidValueError, match="'fsdp'"):
        dk.check_equivalence(build, _batch(), nn.MSELoss(), parallel="fsdp")
    with pytest.raises(dk.InvalidValueError, match="pair"):
        dk.check_equivalence(build, _batch()[0], nn.MSELoss())
    with pytest.raises(dk.InvalidValueError, match="module-level"):
        dk.check_equivalence(lambda: build(), _batch(), nn.MSELoss(), timeout=TIMEOUT)


def test_no_process_group_left_behind() -> None:
    assert not (dist.is_available() and dist.is_initialized())


def test_progress_is_shown_on_stderr_while_the_parallel_step_runs(monkeypatch, capsys) -> None:
    from devicekit.strategy import equivalence

    class Stop(Exception):
        pass

    seen: list[str] = []

    def parallel_step(*_args: Any) -> Any:
        seen.append(capsys.readouterr().err)
        raise Stop

    monkeypatch.setattr(equivalence, "_run_parallel", parallel_step)
    with pytest.raises(Stop):
        dk.check_equivalence(build, _batch(), nn.MSELoss(), world_size=2)
    assert seen == ["check_equivalence: running the ddp step on 2 rank(s), then one process...\n"]


def test_progress_reports_the_time_when_done(capsys) -> None:
    dk.check_equivalence(build, _batch(), nn.MSELoss(), parallel=averaged_correctly)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("check_equivalence: running the averaged_correctly step")
    assert lines[-1].startswith("check_equivalence: parallel step done in ")
