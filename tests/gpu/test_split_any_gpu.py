"""dk.split of a non-Sequential model over a real GPU and the CPU: trains and matches unsplit."""

from __future__ import annotations

import pytest
import torch

import devicekit as dk
from tests.modelparallel.any_models import GPT, ResNet, any_sample, loss_of, twin

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("factory, name", [(GPT, "gpt"), (ResNet, "resnet")])
def test_split_over_cuda_and_cpu_trains_like_unsplit(factory: type, name: str) -> None:
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, ref = twin(lambda: (torch.manual_seed(0), factory())[1])
    x = any_sample(name)
    split = dk.split(model, ["cuda:0", "cpu"], sample=x)
    assert {p.device.type for p in model.parameters()} == {"cuda", "cpu"}
    if name == "gpt":  # the tied head runs where the embedding lives
        assert model.lm_head.weight.device == model.wte.weight.device == torch.device("cuda:0")
    # SGD, not Adam: Adam's g / sqrt(v) turns float-level GPU/CPU differences in near-zero
    # gradients into full-size steps, which would compare kernels, not the split
    opt = torch.optim.SGD(split.parameters(), lr=1e-2, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    for _ in range(5):
        for m, o in ((split, opt), (ref, ref_opt)):
            o.zero_grad()
            out = m(x)
            loss_of(out.cpu()).backward()
            o.step()
    torch.testing.assert_close(split(x).cpu(), ref(x), atol=1e-4, rtol=1e-3)
    for got, want in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-3)


def test_skip_across_gpu_and_cpu_is_joined() -> None:
    model, ref = twin(lambda: (torch.manual_seed(0), ResNet())[1])
    x = any_sample("resnet")
    split = dk.split(model, ["cuda:0", "cpu"], balance=[3, 5], sample=x)
    out = split(x)  # x + self.layer1(x) meets cuda:0 and cpu
    assert out.device.type == "cpu" and split.mixed_moves >= 1
    torch.testing.assert_close(out, ref(x), atol=1e-4, rtol=1e-3)
