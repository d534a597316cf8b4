"""Port of torchgpipe tests/test_microbatch.py to devicekit.modelparallel.microbatch.

Difference, deliberate: devicekit cuts any nested structure (tuples, dicts, namedtuples,
dataclasses) and hands values that are not tensors (flags, ints) to every micro-batch, where
torchgpipe accepts only a tensor or a tuple of tensors; every tensor of a batch must share the
batch size (torchgpipe chunks each on its own, which silently misaligns samples).
"""

from __future__ import annotations

import pytest
import torch

import devicekit as dk
from devicekit.modelparallel.microbatch import gather, move, scatter


def test_check() -> None:
    """upstream test_check. Difference: non-tensor values ride along; a batch with no tensor, or
    a 0-d tensor (nothing to cut), is refused in one line."""
    assert len(scatter((torch.zeros(4), torch.zeros(4)), 2)) == 2
    parts = scatter((torch.zeros(4), 2), 2)
    assert [p[1] for p in parts] == [2, 2]
    for bad, words in [(42, "holds no tensor"), ("str", "holds no tensor"), (torch.tensor(42), "0-d")]:
        with pytest.raises(dk.InvalidValueError, match=words):
            scatter(bad, 2)


def test_gather_tensors() -> None:
    """upstream test_gather_tensors"""
    assert gather([torch.zeros(1, 1), torch.zeros(1, 1)]).size() == (2, 1)


def test_gather_tuples() -> None:
    """upstream test_gather_tuples"""
    a = (torch.zeros(1, 1), torch.zeros(2, 2))
    b = (torch.zeros(1, 1), torch.zeros(2, 2))
    ab = gather([a, b])
    assert isinstance(ab, tuple) and ab[0].size() == (2, 1) and ab[1].size() == (4, 2)


def test_scatter_tensor() -> None:
    """upstream test_scatter_tensor"""
    a, b = scatter(torch.zeros(2, 1), chunks=2)
    assert a.size() == (1, 1) and b.size() == (1, 1)


def test_scatter_tuple() -> None:
    """upstream test_scatter_tuple. Difference: the tensors must share a batch size (upstream
    cuts (2, 1) and (4, 2) tensors each in halves; devicekit refuses that)."""
    a, b = scatter((torch.zeros(2, 1), torch.zeros(2, 2)), chunks=2)
    assert isinstance(a, tuple) and isinstance(b, tuple)
    assert a[0].size() == (1, 1) and b[1].size() == (1, 2)
    with pytest.raises(dk.InvalidValueError, match="different first dimensions"):
        scatter((torch.zeros(2, 1), torch.zeros(4, 2)), chunks=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="upstream test_default_device_index needs CUDA")
def test_default_device_index() -> None:
    """upstream test_default_device_index: "cuda" without an index means the current device."""
    a, b = (move(t, torch.device("cuda")) for t in scatter(torch.rand(2, 1), chunks=2))
    assert a.is_cuda and b.is_cuda and gather([a, b]).is_cuda
