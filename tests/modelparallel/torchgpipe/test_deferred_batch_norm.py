"""Port of torchgpipe tests/test_deferred_batch_norm.py to dk.DeferredBatchNorm.

Difference: torchgpipe's DeferredBatchNorm takes ``chunks`` and commits by itself after that
many micro-batches; devicekit's is told when a mini-batch ends (``commit()``, which
dk.Pipeline calls once per call), so it has no ``chunks`` and a short last mini-batch (fewer
micro-batches than chunks) is still committed exactly once. Images are 32x32, not 224x224.
"""

from __future__ import annotations

from copy import deepcopy
from itertools import chain

import pytest
import torch
from torch import nn, optim

import devicekit as dk

CHUNKS = 4


def tilt_dist(x: torch.Tensor) -> torch.Tensor:
    """Tilt variance by channel and mean by sample (upstream's helper)."""
    rgb = x.transpose(0, 1)
    rgb[0] *= 1
    rgb[1] *= 10
    rgb[2] *= 100
    for i, single in enumerate(x):
        single += 2**i
    return x


def chunked_forward(model: nn.Module, x: torch.Tensor, chunks: int = CHUNKS) -> torch.Tensor:
    out = torch.cat([model(chunk) for chunk in x.chunk(chunks)])
    if model.training:
        dk.DeferredBatchNorm.commit_all(model)  # the end of the mini-batch (the pipeline's job)
    return out


def sample() -> torch.Tensor:
    torch.manual_seed(0)
    return tilt_dist(torch.rand(16, 3, 32, 32))


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_transparency(chunks: int, input_requires_grad: bool) -> None:
    """upstream test_transparency"""
    bn = nn.BatchNorm2d(3)
    dbn = dk.DeferredBatchNorm.convert(deepcopy(bn))
    input1 = sample()
    input2 = input1.clone()
    input1.requires_grad = input_requires_grad
    input2.requires_grad = input_requires_grad
    output1 = chunked_forward(bn, input1, chunks)
    output2 = chunked_forward(dbn, input2, chunks)
    torch.testing.assert_close(output1, output2, atol=1e-4, rtol=0)
    output1.mean().backward()
    output2.mean().backward()
    torch.testing.assert_close(bn.weight.grad, dbn.weight.grad, atol=1e-4, rtol=0)
    if input_requires_grad:
        assert input1.grad is not None and input2.grad is not None
        torch.testing.assert_close(input1.grad, input2.grad, atol=1e-4, rtol=0)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats(momentum: float | None) -> None:
    """upstream test_running_stats"""
    bn = nn.BatchNorm2d(3, momentum=momentum)
    dbn = dk.DeferredBatchNorm.convert(deepcopy(bn))
    x = sample()
    bn(x)
    chunked_forward(dbn, x)
    torch.testing.assert_close(bn.running_mean, dbn.running_mean, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(bn.running_var, dbn.running_var, atol=1e-4, rtol=1e-5)


def test_convert_deferred_batch_norm() -> None:
    """upstream test_convert_deferred_batch_norm (no chunks: converting again is a no-op)."""
    bn = dk.DeferredBatchNorm.convert(nn.BatchNorm2d(3, track_running_stats=False))
    assert type(bn) is nn.BatchNorm2d  # nothing to defer without running statistics
    dbn = dk.DeferredBatchNorm(3)
    assert dk.DeferredBatchNorm.convert(dbn) is dbn


def test_eval() -> None:
    """upstream test_eval"""
    bn = nn.BatchNorm2d(3)
    dbn = dk.DeferredBatchNorm.convert(deepcopy(bn))
    x = sample()
    bn(x)
    chunked_forward(dbn, x)
    bn.eval()
    dbn.eval()
    torch.testing.assert_close(bn(x), dbn(x), atol=1e-4, rtol=1e-5)


def test_optimize() -> None:
    """upstream test_optimize"""
    bn = nn.BatchNorm2d(3)
    dbn = dk.DeferredBatchNorm.convert(deepcopy(bn))
    opt = optim.SGD(chain(bn.parameters(), dbn.parameters()), lr=1.0)
    for i in range(5):
        x = tilt_dist(torch.rand(16, 3, 32, 32))
        bn.train()
        dbn.train()
        bn(x).sum().backward()
        chunked_forward(dbn, x).sum().backward()
        opt.step()
        bn.eval()
        dbn.eval()
        with torch.no_grad():
            assert torch.allclose(bn(x), dbn(x), atol=1e-1 * (10**i))


def test_conv_bn() -> None:
    """upstream test_conv_bn: per-micro-batch normalisation trains the conv differently, but the
    first step's running statistics are the mini-batch's."""
    torch.manual_seed(0)
    bn = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    dbn = dk.DeferredBatchNorm.convert(deepcopy(bn))
    x = sample()
    opt = optim.SGD(chain(bn.parameters(), dbn.parameters()), lr=0.1)
    a = bn(x)
    b = chunked_forward(dbn, x)
    assert not torch.allclose(a, b)  # per-mini-batch vs per-micro-batch normalisation
    a.sum().backward()
    b.sum().backward()
    opt.step()
    opt.zero_grad()
    assert not torch.allclose(bn[0].weight, dbn[0].weight)
    torch.testing.assert_close(bn[1].running_mean, dbn[1].running_mean, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(bn[1].running_var, dbn[1].running_var, atol=1e3, rtol=0)
    a = bn(x)
    b = chunked_forward(dbn, x)
    assert not torch.allclose(bn[1].running_mean, dbn[1].running_mean, atol=1e-4)


def test_input_requiring_grad() -> None:
    """upstream test_input_requiring_grad: the tracked statistics hold no autograd graph."""
    dbn = dk.DeferredBatchNorm(3)
    x = tilt_dist(torch.rand(16, 3, 32, 32)).requires_grad_()
    for chunk in x.chunk(CHUNKS):
        dbn(chunk)
    assert dbn._mean is not None and not dbn._mean.requires_grad and dbn._mean.grad_fn is None
    dbn.commit()
    assert not dbn.running_mean.requires_grad and dbn.running_var.grad_fn is None
