"""Splitting a batch by device speed: 3:2:1 shares, gradients equal to the single-device step,
``weights="auto"`` from a simulated H100 + A100 + T4, one-line errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit.parallel.balanced_dp import combine_losses
from devicekit.parallel.weighted_split import chunk, resolve_weights, split_sizes
from tests.mixed import mixed_machine


def test_split_sizes_are_proportional_and_whole() -> None:
    assert split_sizes(12, [3, 2, 1]) == [6, 4, 2]
    assert split_sizes(13, [3, 2, 1]) == [7, 4, 2]
    assert sum(split_sizes(1001, [989.4, 312.0, 65.0])) == 1001
    assert split_sizes(3, [100, 1, 1]) == [1, 1, 1]  # everyone gets one while the batch allows


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_3_2_1_split_gives_the_single_device_gradients(reduction: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    loss_fn(net(x), y).backward()
    expected = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    sizes = split_sizes(12, [3, 2, 1])
    pieces = chunk((x, y), sizes)
    assert [p[0].shape[0] for p in pieces] == [6, 4, 2]
    losses = [loss_fn(net(px), py) for px, py in pieces]  # what each replica computes
    combine_losses(losses, sizes, reduction).backward()
    for got, want in zip((p.grad for p in net.parameters()), expected, strict=True):
        torch.testing.assert_close(got, want)


def test_chunk_keeps_structure_and_repeats_non_tensors() -> None:
    batch = {"x": torch.arange(6), "meta": "s", "pair": (torch.ones(6, 2), 3)}
    a, b = chunk(batch, [4, 2])
    assert a["x"].tolist() == [0, 1, 2, 3] and b["x"].tolist() == [4, 5]
    assert a["meta"] == "s" and b["pair"][0].shape == (2, 2) and b["pair"][1] == 3


def test_auto_weights_follow_the_capability_score(simulate: Callable[..., Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    simulate(mixed_machine())  # PCI order T4, H100, A100; CUDA_DEVICE_ORDER unset: fastest first
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert resolve_weights("auto", [0, 1, 2]) == [65.0, 989.4, 312.0]
    sizes = split_sizes(1366, resolve_weights("auto", [1, 2, 0]) or [])
    assert sizes == [989, 312, 65]


@pytest.mark.parametrize(("weights", "message"), [
    ([1, 2], "2 entries for 3 devices"), ([1, 0, 1], "0 is not a positive number"),
    ("fast", "weights='fast'"), ([1, float("nan"), 1], "nan"),
])
def test_bad_weights_are_named(weights: object, message: str) -> None:
    with pytest.raises(dk.InvalidValueError, match=message):
        resolve_weights(weights, [0, 1, 2])
