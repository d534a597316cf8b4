"""dk.distributed_loader(weights=...): 3 gloo ranks get 3:2:1 batches and exact gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import devicekit as dk
from tests.parallel import weighted_workloads as work


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return dk.launch(work.scenarios, nprocs=3, devices="cpu", timeout=90)


def test_batches_are_shared_3_2_1_and_every_rank_runs_the_same_steps(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["batch_sizes"] == [6, 4, 2]
        assert r["steps"] == 4                                    # 48 samples / 12 per step
    assert [r["hook"]["rows"] for r in ranks] == [6, 4, 2]


def test_every_epoch_covers_the_dataset_once_and_reshuffles(ranks: list[dict]) -> None:
    for epoch in (0, 1):
        together = sorted(i for r in ranks for i in r["indices"][epoch])
        assert together == list(range(work.SAMPLES))
    assert ranks[0]["indices"][0] != ranks[0]["indices"][1]
    assert [len(r["indices"][0]) for r in ranks] == [24, 16, 8]


def test_comm_hook_gives_the_one_process_gradient(ranks: list[dict]) -> None:
    for r in ranks:
        torch.testing.assert_close(r["hook"]["got"], r["hook"]["want"])


def test_loss_scale_gives_the_one_process_gradient(ranks: list[dict]) -> None:
    assert [r["loss_scale"] for r in ranks] == pytest.approx([1.5, 1.0, 0.5])
    for r in ranks:
        torch.testing.assert_close(r["scaled"]["got"], r["scaled"]["want"])


def test_unweighted_average_would_be_wrong_so_it_is_refused(ranks: list[dict]) -> None:
    assert not torch.allclose(ranks[0]["unweighted"]["got"], ranks[0]["unweighted"]["want"],
                              atol=1e-4)
    assert "dk.ddp(model, loader=loader)" in ranks[0]["refused"]
    assert "[6, 4, 2]" in ranks[0]["refused"]


def test_bad_weights_are_one_line_errors(ranks: list[dict]) -> None:
    assert "2 entries for a world of 3" in ranks[0]["wrong_count"]
    assert "weights='auto' needs every rank on a known GPU; rank(s) [0, 1, 2]" in ranks[0]["auto_cpu"]


def test_single_process_weights_are_one_share() -> None:
    dataset = work.dataset()
    loader = dk.distributed_loader(dataset, batch_size=5, weights=[2.0], shuffle=False)
    assert loader.batch_sizes == [5] and loader.loss_scale == 1.0
    assert [len(b[0]) for b in loader] == [5] * 9 + [3]         # one rank: the tail, no padding
    loader = dk.distributed_loader(dataset, batch_size=5, weights=[1], drop_last=True)
    assert len(loader) == 9 and sorted(len(b[0]) for b in loader) == [5] * 9
    for bad in ("fast", [0], [float("nan")], [True], 3):
        with pytest.raises(dk.InvalidValueError, match="weights"):
            dk.distributed_loader(dataset, batch_size=5, weights=bad)
    with pytest.raises(dk.InvalidValueError, match="loader="):
        dk.ddp(work.build_net(), loader=[1, 2])


@pytest.mark.parametrize("weight", [989.4, 1.0, 0.1, 7.3e-5])
def test_one_rank_with_a_measured_weight_gives_every_sample_once(weight: float) -> None:
    """Issue 38: one H200 with weights="auto" (its capability score, one float) and 20 samples
    in batches of 8 gave [0, 1, 2, 3, 4, 4, ...]: the last step was padded to a full batch."""
    dataset = torch.utils.data.TensorDataset(torch.arange(20))
    loader = dk.distributed_loader(dataset, batch_size=8, weights=[weight])
    assert loader.batch_sizes == [8] and loader.loss_scale == 1.0
    for epoch in (0, 1):
        loader.batch_sampler.set_epoch(epoch)
        batches = [b.tolist() for (b,) in loader]
        assert [len(b) for b in batches] == [8, 8, 4] and len(loader) == 3
        assert sorted(i for b in batches for i in b) == list(range(20))


def test_several_ranks_pad_the_last_step_so_shares_stay_exact() -> None:
    """With unequal shares a short last step would change each rank's share of it, so the
    order is padded (documented, as DistributedSampler does): at most G - 1 samples repeat."""
    from devicekit.parallel.weighted_loader import WeightedBatchSampler

    ranks = [WeightedBatchSampler(10, [3, 1], rank, seed=5) for rank in (0, 1)]
    for sampler in ranks:
        sampler.weighting_chosen = True
    batches = [list(sampler) for sampler in ranks]
    assert [[len(b) for b in per_rank] for per_rank in batches] == [[3, 3, 3], [1, 1, 1]]
    together = [i for per_rank in batches for b in per_rank for i in b]
    assert set(together) == set(range(10)) and len(together) == 12  # 2 = G - 2 repeated
