"""``BalancedDataParallel(weights=...)`` on real GPUs: the weighted split's gradients equal the
single-device step (one GPU: the whole batch goes through the weighted path)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import devicekit as dk

pytestmark = pytest.mark.gpu


def test_weighted_split_matches_single_device_gradients() -> None:
    torch.manual_seed(0)
    n = torch.cuda.device_count()
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).cuda()
    x, y = torch.randn(24, 8, device="cuda"), torch.randint(0, 4, (24,), device="cuda")
    nn.CrossEntropyLoss()(net(x), y).backward()
    expected = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    weights = [3, 2, 1][:n] if n <= 3 else [1] * n
    model = dk.BalancedDataParallel(net, nn.CrossEntropyLoss(), weights=weights)
    model(x, y).backward()
    for got, want in zip((p.grad for p in net.parameters()), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    auto = dk.BalancedDataParallel(net, nn.CrossEntropyLoss(), weights="auto")
    assert auto.weights is not None and len(auto.weights) == n


def test_distributed_loader_auto_weights_on_a_real_gpu() -> None:
    """One process on a GPU: 'auto' reads this GPU's capability score; the share is all of it,
    and one rank needs no padding: every sample once, the last batch shorter."""
    dataset = torch.utils.data.TensorDataset(torch.arange(20))
    loader = dk.distributed_loader(dataset, batch_size=8, weights="auto")
    assert loader.batch_sizes == [8] and loader.loss_scale == 1.0
    batches = [b for (b,) in loader]
    assert [len(b) for b in batches] == [8, 8, 4]
    assert sorted(int(i) for b in batches for i in b) == list(range(20))
