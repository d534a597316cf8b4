"""dk.Pipeline for any module: traced into a chain of stages (modelparallel/chain.py), or cut at named modules.

The seeds' Net, a ResNet with skips (one across whole stages) and a GPT with tied embeddings are
pipelined over CPU devices and compared with the unsplit model (outputs, gradients, a few
optimizer steps). BatchNorm models use chunks=1 or eval mode (per-micro-batch statistics are the
pipeline's documented difference, as in test_pipeline.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

import devicekit as dk
from devicekit.modelparallel.chain import Chain, to_chain
from devicekit.modelparallel.per_sample import check_per_sample
from tests.modelparallel.any_models import ANY_MODELS, GPT, ResNet, any_sample, loss_of, twin

CASES = [(name, parts, chunks) for name, parts in [("net", 2), ("resnet", 2), ("resnet", 3), ("gpt", 2), ("gpt", 3)]
         for chunks in (1, 4)]


@pytest.mark.parametrize("name, parts, chunks", CASES)
def test_same_outputs_and_gradients_as_unsplit(name: str, parts: int, chunks: int) -> None:
    model, ref = twin(ANY_MODELS[name])
    x = any_sample(name)
    with dk.Pipeline(model, ["cpu"] * parts, chunks=chunks, sample=x) as pipe:
        assert len(pipe.parts) == parts and pipe.module is model
        if name == "resnet" and chunks > 1:  # BatchNorm: per-micro-batch statistics in training
            pipe.eval()
            ref.eval()
        out, want = pipe(x), ref(x)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
        loss_of(out).backward()
        loss_of(want).backward()
        for (pname, got), expected in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert got.grad is not None, pname
            torch.testing.assert_close(got.grad, expected.grad, atol=1e-5, rtol=1e-4)
        for got, expected in zip(model.buffers(), ref.buffers(), strict=True):
            torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("name, parts, chunks", [("net", 2, 4), ("resnet", 3, 1), ("gpt", 3, 4), ("gpt", 2, 1)])
def test_trains_to_the_same_parameters(name: str, parts: int, chunks: int) -> None:
    model, ref = twin(ANY_MODELS[name])
    x = any_sample(name)
    pipe = dk.Pipeline(model, ["cpu"] * parts, chunks=chunks, sample=x)
    # SGD: Adam would blow float noise in the key bias's (mathematically zero) gradient up to lr
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        for m, o in ((pipe, opt), (ref, ref_opt)):
            o.zero_grad()
            loss_of(m(x)).backward()
            o.step()
    pipe.close()
    for key, got in model.state_dict().items():
        torch.testing.assert_close(got, ref.state_dict()[key], atol=1e-5, rtol=1e-4, msg=key)


def test_parameters_are_the_models_own_and_tied_stays_tied() -> None:
    model = GPT()
    own = {id(p) for p in model.parameters()}
    pipe = dk.Pipeline(model, ["cpu", "cpu"], chunks=2)
    assert {id(p) for part in pipe.parts for p in part.parameters()} == own
    assert model.lm_head.weight is model.wte.weight
    assert list(pipe.module.state_dict()) == list(GPT().state_dict())
    assert list(pipe.state_dict()) == [f"module.{k}" for k in GPT().state_dict()]
    assert pipe.plan.counts == [sum(pipe.plan.counts[:1]), pipe.plan.counts[1]]


def test_tied_parameters_across_two_devices_are_refused_by_name() -> None:
    with pytest.raises(dk.SplitError, match=r"wte\.weight.*shared \(tied\)"):
        dk.Pipeline(GPT(), ["cpu", "meta"], chunks=2)


def test_the_chain_passes_live_values_across_cuts() -> None:
    """ResNet's x + layer1(x): the skip's input rides through the layer1 stages."""
    model = ResNet()
    chain = to_chain(model)
    assert isinstance(chain, nn.Sequential) and list(chain._modules) == [
        "stem", "bn", "layer1_0", "layer1_1", "layer2_0", "layer2_1", "pool", "fc"]
    x = any_sample("resnet")
    torch.testing.assert_close(chain(x), model(x))
    carried = chain[2](chain[1](chain[0](x)))
    assert isinstance(carried, tuple) and len(carried) == 2  # layer1.0's output and the skip's input


class Branchy(nn.Module):
    """Data-dependent control flow in the model's own forward: not a chain."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if x.sum() > 0:
            x = x * 2
        return self.b(x)


def test_data_dependent_control_flow_is_refused_in_one_line() -> None:
    with pytest.raises(dk.SplitError) as info:
        dk.Pipeline(Branchy(), ["cpu", "cpu"], chunks=2)
    message = str(info.value)
    assert "\n" not in message and "does not trace" in message and "control flow on a tensor's value" in message
    assert "stages=['b']" in message and "dk.split" in message


def test_following_the_refusals_stages_advice_works() -> None:
    """stages=['b'] (what the refusal offers) runs Branchy's own forward, cut before b by hooks."""
    model = Branchy()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 4)
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=1, stages=["b"]) as pipe:
        out = pipe(x)
    want = ref(x)
    assert torch.equal(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True))


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y if bool(y.abs().max() < 1e6) else -y  # control flow inside a stage (per sample)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(4, 4), Gated())
        self.second = Gated()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x)) + x)


def test_control_flow_inside_a_stage_is_fine() -> None:
    model, ref = twin(Outer)
    x = torch.randn(6, 4)
    pipe = dk.Pipeline(model, ["cpu", "cpu"], chunks=3, stages=["first.1", "head"])
    assert [list(p._modules) for p in pipe.parts] == [["first_0"], ["first_1", "head"]]
    torch.testing.assert_close(pipe(x), ref(x))
    auto = dk.Pipeline(copy.deepcopy(ref), ["cpu", "cpu"], chunks=3)  # units are whole: also traces
    torch.testing.assert_close(auto(x), ref(x))


def test_named_boundaries_cut_there() -> None:
    model, ref = twin(ANY_MODELS["gpt"])
    x = any_sample("gpt")
    pipe = dk.Pipeline(model, ["cpu", "cpu"], chunks=4, stages=["wte", "blocks.2"])
    assert [p.layer_names for p in pipe.plan.parts] == [("wte",), ("blocks_2",)]
    out, want = pipe(x), ref(x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    loss_of(out).backward()
    loss_of(want).backward()
    torch.testing.assert_close(model.wte.weight.grad, ref.wte.weight.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("stages, match", [
    (["blocks.9"], "no submodule 'blocks.9'"),
    (["blocks.0", "blocks.0.attn"], "'blocks.0' contains 'blocks.0.attn'"),
    ("blocks.1", "must be a list"),
])
def test_bad_stage_names_are_one_line_errors(stages: object, match: str) -> None:
    with pytest.raises(dk.InvalidValueError, match=match) as info:
        dk.Pipeline(GPT(), ["cpu", "cpu"], chunks=2, stages=stages)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_named_boundaries_inside_units_and_in_a_sequential() -> None:
    model, ref = twin(ANY_MODELS["gpt"])
    x = any_sample("gpt")
    pipe = dk.Pipeline(model, ["cpu", "cpu"], chunks=2, stages=["blocks.1.attn"])  # opens blocks.1
    assert [p.layer_names for p in pipe.plan.parts] == [("wte",), ("blocks_1_attn",)]
    torch.testing.assert_close(pipe(x), ref(x), atol=1e-5, rtol=1e-4)
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))
    cut = dk.Pipeline(seq, ["cpu", "cpu"], chunks=2, stages=["2"])
    assert cut.plan.counts == [1, 1]
    y = torch.randn(4, 4)
    torch.testing.assert_close(cut(y), seq(y))


def test_a_name_the_forward_never_calls_is_refused() -> None:
    model = ANY_MODELS["net"]()
    model.unused = nn.Linear(2, 2)
    with pytest.raises(dk.InvalidValueError, match="'unused' is not called"):
        dk.Pipeline(model, ["cpu", "cpu"], chunks=2, stages=["sub_network1", "unused"])


class Centred(nn.Module):
    """Subtracts the batch mean: micro-batches would each subtract their own."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h - h.mean(0))


def test_an_op_that_mixes_samples_is_refused_naming_it() -> None:
    x = torch.randn(8, 4)
    with pytest.raises(dk.SplitError, match=r"method \.mean\(\).*mixes samples across the batch"):
        dk.Pipeline(Centred(), ["cpu", "cpu"], chunks=4, sample=x)
    pipe = dk.Pipeline(Centred(), ["cpu", "cpu"], chunks=4)  # no sample: checked on the first batch
    with pytest.raises(dk.SplitError, match="mixes samples"):
        pipe(x)
    model, ref = twin(Centred)
    one = dk.Pipeline(model, ["cpu", "cpu"], chunks=1, sample=x)  # one micro-batch: the whole batch
    torch.testing.assert_close(one(x), ref(x))


def test_masks_constants_and_batchnorm_pass_the_per_sample_check() -> None:
    for name in ("gpt", "resnet"):
        model = ANY_MODELS[name]()
        chain = to_chain(model)
        assert isinstance(chain, Chain) and isinstance(chain[0], fx.GraphModule)
        check_per_sample(chain, any_sample(name))  # the causal mask, pos[:, :t], BatchNorm: fine
        assert model.training


def test_the_first_batch_check_runs_on_parts_already_on_their_devices() -> None:
    """Without a sample, the check runs on the first batch after the stages moved; on ["cpu",
    "meta"] an op meeting a cpu and a meta tensor would raise, so inputs are moved per op."""
    model = ANY_MODELS["net"]()
    pipe = dk.Pipeline(model, ["cpu", "meta"], chunks=2)
    assert model.sub_network2.weight.device.type == "meta"
    out = pipe(torch.randn(4, 100))
    assert out.shape == (4, 10) and out.device.type == "meta"
