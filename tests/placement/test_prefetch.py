"""Prefetcher on non-CUDA devices: a plain loop that moves each batch; len() where possible."""

from __future__ import annotations

import pytest
import torch

import devicekit as dk


def test_prefetcher_moves_every_batch_in_order() -> None:
    batches = [{"x": torch.full((2,), float(i)), "id": i} for i in range(5)]
    out = list(dk.Prefetcher(batches, "meta"))
    assert [b["id"] for b in out] == list(range(5))
    assert all(b["x"].device.type == "meta" for b in out)


def test_prefetcher_on_cpu_is_pass_through() -> None:
    batches = [(torch.ones(1), torch.zeros(1)) for _ in range(3)]
    out = list(dk.Prefetcher(batches, "cpu"))
    assert all(a is b for pair, orig in zip(out, batches, strict=True) for a, b in zip(pair, orig, strict=True))


def test_prefetcher_len_follows_the_iterable() -> None:
    assert len(dk.Prefetcher(torch.utils.data.DataLoader(range(10), batch_size=3), "cpu")) == 4
    with pytest.raises(TypeError, match="generator"):
        len(dk.Prefetcher((i for i in range(3)), "cpu"))


def test_prefetcher_is_reiterable_over_a_reiterable_source() -> None:
    prefetcher = dk.Prefetcher([torch.ones(1)] * 2, "cpu")
    assert len(list(prefetcher)) == len(list(prefetcher)) == 2


def test_prefetcher_rejects_bad_device() -> None:
    with pytest.raises(dk.InvalidDeviceError, match="gpu"):
        dk.Prefetcher([], "gpu")


def test_a_non_iterable_is_refused_at_once() -> None:
    with pytest.raises(dk.InvalidValueError, match="got int"):
        dk.Prefetcher(3, "cpu")  # type: ignore[arg-type]
