"""half() keeps norm layers fp32 and runs; mixed_precision picks dtype and scaler."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import devicekit as dk


class BNNet(nn.Module):
    """The seeds' myNetworkBN, with a LayerNorm and a GroupNorm too."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(10, 8)
        self.bn = nn.BatchNorm1d(8)
        self.ln = nn.LayerNorm(8)
        self.gn = nn.GroupNorm(2, 8)
        self.l2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.gn(self.ln(self.bn(self.l1(x)))))


NORMS = ("bn", "ln", "gn")


def test_half_bf16_keeps_norm_layers_fp32_and_trains() -> None:
    torch.manual_seed(0)
    model = dk.half(BNNet(), dtype=torch.bfloat16)
    assert model.l1.weight.dtype == torch.bfloat16 and model.l2.bias.dtype == torch.bfloat16
    for name in NORMS:
        layer = getattr(model, name)
        assert all(p.dtype == torch.float32 for p in layer.parameters()), name
    assert model.bn.running_mean.dtype == torch.float32
    assert model.bn.num_batches_tracked.dtype == torch.int64

    seen: dict[str, torch.dtype] = {}
    model.bn.register_forward_hook(lambda m, args, out: seen.update(bn_in=args[0].dtype, bn_out=out.dtype))
    x = torch.randn(16, 10)  # fp32 input: cast to bf16 on the way in
    out = model(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert seen["bn_in"] == torch.float32  # the norm layer computed in fp32
    out.float().sum().backward()
    assert model.bn.weight.grad is not None and model.bn.weight.grad.dtype == torch.float32
    assert model.l1.weight.grad is not None and model.l1.weight.grad.dtype == torch.bfloat16
    assert model.bn.num_batches_tracked.item() == 1

    model.eval()
    assert model(x).dtype == torch.bfloat16


def test_half_matches_fp32_model_closely() -> None:
    torch.manual_seed(0)
    reference = BNNet().eval()
    converted = dk.half(BNNet().eval(), dtype=torch.bfloat16)
    converted.load_state_dict({k: v.to(converted.state_dict()[k].dtype) for k, v in reference.state_dict().items()})
    x = torch.randn(8, 10)
    assert torch.allclose(converted(x).float(), reference(x), atol=0.1, rtol=0.05)


def test_half_is_idempotent_and_respects_custom_keep() -> None:
    model = BNNet()
    dk.half(model, dtype=torch.bfloat16)
    dk.half(model, dtype=torch.bfloat16, keep_fp32=[nn.BatchNorm1d])
    assert model.bn.weight.dtype == torch.float32
    assert model.ln.weight.dtype == torch.bfloat16
    assert len(model._devicekit_precision_hooks) == 3  # bn pre + post hook, input cast
    assert model(torch.randn(4, 10)).dtype == torch.bfloat16


def test_half_without_cast_inputs_needs_low_precision_input() -> None:
    model = dk.half(BNNet(), dtype=torch.bfloat16, cast_inputs=False)
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 10))
    assert model(torch.randn(4, 10, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_half_bad_arguments() -> None:
    with pytest.raises(dk.InvalidValueError, match="int8"):
        dk.half(BNNet(), dtype=torch.int8)
    with pytest.raises(dk.InvalidValueError, match="keep_fp32"):
        dk.half(BNNet(), keep_fp32=["BatchNorm"])  # type: ignore[list-item]
    with pytest.raises(dk.InvalidValueError, match="Module"):
        dk.half("model")  # type: ignore[type-var]


def test_mixed_precision_on_cpu_is_bf16_without_scaler() -> None:
    amp = dk.mixed_precision("cpu")
    assert amp.dtype == torch.bfloat16 and not amp.uses_scaler
    assert not amp.scaler.is_enabled()
    model = BNNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.l1.weight.detach().clone()
    with amp:
        out = model(torch.randn(8, 10))
        assert out.dtype == torch.bfloat16
    amp.backward_step(out.float().pow(2).mean(), optimizer)
    assert not torch.equal(before, model.l1.weight)


def test_mixed_precision_fp16_gets_a_real_scaler() -> None:
    amp = dk.mixed_precision("cpu", dtype=torch.float16)
    assert amp.dtype == torch.float16 and amp.uses_scaler and amp.scaler.is_enabled()
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    amp.backward_step((param * 2).sum(), optimizer)
    assert torch.allclose(param.detach(), torch.full((2,), 0.8))


def test_mixed_precision_bad_input() -> None:
    with pytest.raises(dk.InvalidValueError, match="float32"):
        dk.mixed_precision("cpu", dtype=torch.float32)
    with pytest.raises(dk.InvalidDeviceError, match="gpu"):
        dk.mixed_precision("gpu")


def test_shared_norm_layer_gets_one_set_of_hooks() -> None:
    norm = nn.LayerNorm(4)
    model = nn.Sequential(nn.Linear(4, 4), norm, nn.Linear(4, 4), norm)
    dk.half(model, dtype=torch.bfloat16)
    assert len(norm._forward_pre_hooks) == 1 and len(norm._forward_hooks) == 1
    assert model(torch.randn(2, 4)).dtype == torch.bfloat16
