"""The zoo (tests/modelparallel/zoo_models.py) through dk.split and dk.Pipeline at chunks 1, 2 and 4.

For every model: building leaves every parameter and buffer as it was; then either the
constructor refuses with a DeviceKitError naming the reason, or outputs, gradients, and
parameters and buffers after one SGD step equal the unsplit model's. Nothing in between.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

import devicekit as dk
from tests.modelparallel.zoo_models import ZOO, zoo_batch, zoo_model

KINDS = ["split", "chunks1", "chunks2", "chunks4"]


def _leaves(out: Any) -> list[torch.Tensor]:
    if isinstance(out, PackedSequence):
        return [pad_packed_sequence(out, batch_first=True)[0]]
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for k in sorted(out) for t in _leaves(out[k])]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _leaves(o)]
    return []


def _loss(out: Any) -> torch.Tensor:
    return sum((t.float() ** 2).mean() + t.float().sum() * 0.01 for t in _leaves(out) if t.is_floating_point())


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def _build(kind: str, model: nn.Module, devices: list[str], x: Any) -> nn.Module:
    if kind == "split":
        return dk.split(model, devices, sample=x)
    return dk.Pipeline(model, devices, chunks=int(kind[-1]), sample=x)


def _refusal(name: str, kind: str) -> str | None:
    entry = ZOO[name]
    if kind == "split" or entry.refused is None:
        return None
    return entry.refused if int(kind[-1]) >= entry.refused_chunks else None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_matches_unsplit_or_is_refused_by_name(name: str, kind: str) -> None:
    model = zoo_model(name)
    ref = copy.deepcopy(model)
    x = zoo_batch(name)
    before = _state(model)
    refused = _refusal(name, kind)
    if refused is not None:
        with pytest.raises(dk.DeviceKitError, match=refused):
            _build(kind, model, ["cpu", "cpu"], x)
        after = _state(model)
        assert all(torch.equal(after[k], v) for k, v in before.items()), "a refused build changed the model"
        return
    built = _build(kind, model, ["cpu", "cpu"], x)
    try:
        after = _state(model)
        changed = [k for k, v in before.items() if not torch.equal(after[k], v)]
        assert not changed, f"building changed {changed}"
        if name == "resnet" and kind in ("chunks2", "chunks4"):  # BatchNorm: per-micro-batch statistics
            built.eval()
            ref.eval()
        out, want = built(x), ref(x)
        got, expected = _leaves(out), _leaves(want)
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        _loss(out).backward()
        _loss(want).backward()
        for (pname, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), f"{pname}: grad {p.grad is not None} vs {q.grad is not None}"
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=pname)
        for m in (model, ref):
            with torch.no_grad():
                for p in m.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, ref.state_dict()[key], atol=1e-5, rtol=1e-4, msg=key)
    finally:
        if isinstance(built, dk.Pipeline):
            built.close()


FLOW = ["lstm", "packed_gru", "masked_attention", "dict_out", "unet", "stop_grad_target"]


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("name", FLOW)
def test_zoo_flows_across_devices(name: str, chunks: int) -> None:
    """On ["cpu", "meta"] every activation (a PackedSequence, h_n, masks) reaches the next part's device."""
    model = zoo_model(name)
    x = zoo_batch(name)
    want = _leaves(copy.deepcopy(model)(x))
    with dk.Pipeline(model, ["cpu", "meta"], chunks=chunks, sample=x) as pipe:
        got = _leaves(pipe(x))
    assert [t.shape for t in got] == [t.shape for t in want]
    assert all(t.device.type == "meta" for t in got)
