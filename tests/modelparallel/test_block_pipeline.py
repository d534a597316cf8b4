"""dk.Pipeline run by hooks at module boundaries: stage names, refusals and the advice they give.

A model whose forward torch.fx cannot trace (here: a required second argument) and that holds a
block list is pipelined with its own forward (devicekit/modelparallel/block_pipeline.py). Every
refusal names the model-level reason, and each piece of advice it gives is followed here and
works: stages=[...] names it suggests, "at most k devices", chunks=1, dk.split, use_cache=False.
"""

from __future__ import annotations

import copy
import re
import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import devicekit as dk
from devicekit.modelparallel import Call

pytestmark = pytest.mark.usefixtures("torch_one_thread")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h)) + h


class Stack(nn.Module):
    """Embed, four blocks in a ModuleList, a head and a loss; ``forward(x, target)`` does not trace."""

    def __init__(self, *, mix: bool = False, count: bool = False, loss: str = "mean", again: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(8, 3)
        self.mix, self.loss, self.again, self.count = mix, loss, again, count
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        if self.again:
            h = self.layers[2](h)
        if self.mix:
            h = h - h.mean(0)
        if self.count:
            self.steps.add_(1)
        out = self.head(h)
        if self.loss == "sum":
            loss = F.mse_loss(out, target, reduction="sum")
        elif self.loss == "pairs":  # in-batch negatives: every sample against every other
            loss = (out @ out.T).logsumexp(1).mean()
        else:
            loss = F.mse_loss(out, target)
        return {"out": out, "loss": loss}


def _batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


def _per_micro_batch(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int, how: str) -> dict[str, Any]:
    outs = [model(a, b) for a, b in zip(x.chunk(chunks), y.chunk(chunks), strict=True)]
    losses = torch.stack([o["loss"] for o in outs])
    return {"out": torch.cat([o["out"] for o in outs]), "loss": losses.sum() if how == "sum" else losses.mean()}


@pytest.mark.parametrize("how", ["mean", "sum"])
def test_a_model_that_does_not_trace_is_pipelined_by_hooks_at_its_blocks(how: str) -> None:
    model, x, y = Stack(loss=how), *_batch()
    ref = copy.deepcopy(model)
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=2, sample=Call(x, y)) as pipe:
        assert pipe.plan.parts[1].layer_names[0].startswith("layers.")
        for _ in range(2):
            for p in (*model.parameters(), *ref.parameters()):
                p.grad = None
            out, want = pipe(x, y), _per_micro_batch(ref, x, y, 2, how)
            assert torch.equal(out["out"], want["out"]) and torch.equal(out["loss"], want["loss"])
            out["loss"].backward()
            want["loss"].backward()
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    torch.testing.assert_close(out["loss"], ref(x, y)["loss"])  # a sum joins as a sum, a mean as a mean


def test_stage_names_as_torch_pipelining_names_them_are_honoured() -> None:
    model, x, y = Stack(), *_batch()
    ref = copy.deepcopy(model)
    with dk.Pipeline(model, ["cpu"] * 3, chunks=2, stages=["layers.1", "layers.3"]) as pipe:
        assert [p.layer_names[0] for p in pipe.plan.parts] == ["embed", "layers.1", "layers.3"]
        out = pipe(x, y)
    assert torch.equal(out["out"], _per_micro_batch(ref, x, y, 2, "mean")["out"])


def _follow(message: str) -> list[str]:
    found = re.search(r"stages=(\[[^\]]*\])", message)
    assert found, message
    return eval(found.group(1))  # a list literal of names, from our own message


@pytest.mark.parametrize("stages, devices", [(["layers.1"], 3), (["layers.1", "layers.2", "layers.3"], 2),
                                             (["layers.3"], 2)])
def test_a_wrong_stage_list_is_refused_with_names_that_work(stages: list[str], devices: int) -> None:
    model, x, y = Stack(), *_batch()
    if stages == ["layers.3"]:  # tied to layers.1: it runs where layers.1 lives, so it cannot begin a stage
        model.layers[3].lin.weight = model.layers[1].lin.weight
    with pytest.raises(dk.DeviceKitError) as info:
        dk.Pipeline(model, ["cpu"] * devices, chunks=2, stages=stages, sample=Call(x, y))
    names = _follow(str(info.value))
    ref = copy.deepcopy(model)
    with dk.Pipeline(model, ["cpu"] * devices, chunks=2, stages=names, sample=Call(x, y)) as pipe:
        assert [p.layer_names[0] for p in pipe.plan.parts[1:]] == names
        assert torch.equal(pipe(x, y)["out"], _per_micro_batch(ref, x, y, 2, "mean")["out"])


def test_more_devices_than_units_says_at_most_and_that_works() -> None:
    model, x, y = Stack(), *_batch()
    with pytest.raises(dk.SplitError, match=r"at most (\d+) devices") as info:
        dk.Pipeline(model, ["cpu"] * 8, chunks=2, sample=Call(x, y))  # 4 blocks, 6 units
    most = int(re.search(r"at most (\d+) devices", str(info.value)).group(1))
    with dk.Pipeline(model, ["cpu"] * most, chunks=2, sample=Call(x, y)) as pipe:
        assert len(pipe.plan.parts) == most


@pytest.mark.parametrize("kind, reason", [
    ({"mix": True}, r"output 'out' on micro-batches differs from the whole batch"),
    ({"count": True}, r"buffer 'steps' is written in its forward"),
    ({"loss": "pairs"}, r"output 'loss' is a scalar that is neither a mean nor a sum"),
])
def test_what_micro_batches_would_change_is_refused_and_chunks_1_or_split_run_it(kind: dict[str, Any],
                                                                                 reason: str) -> None:
    model, x, y = Stack(**kind), *_batch()
    ref = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(dk.SplitError, match=reason) as info:
        dk.Pipeline(model, ["cpu", "cpu"], chunks=2, sample=Call(x, y))
    assert "use chunks=1 or dk.split(model, devices)" in str(info.value)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items()), "a refusal changed the model"
    want = ref(x, y)
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=1) as pipe:  # the refused model itself: nothing was placed
        assert torch.equal(pipe(x, y)["out"], want["out"])
    split = dk.split(copy.deepcopy(ref), ["cpu", "cpu"], sample=Call(x, y))
    assert torch.equal(split(x, y)["out"], ref(x, y)["out"])


def test_without_a_sample_the_first_batch_is_checked() -> None:
    model, x, y = Stack(mix=True), *_batch()
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=2) as pipe, pytest.raises(dk.SplitError, match="mixes samples"):
        pipe(x, y)


def test_a_block_run_twice_does_not_begin_a_stage() -> None:
    """layers.2 runs twice per forward: with a sample the cut avoids it; named, it is refused with
    names that work; without a sample (registration order) the first batch's check refuses it."""
    model, x, y = Stack(again=True), *_batch()
    ref = copy.deepcopy(model)
    with dk.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=2, sample=Call(x, y)) as pipe:
        assert "layers.2" not in [p.layer_names[0] for p in pipe.plan.parts]
        assert torch.equal(pipe(x, y)["out"], _per_micro_batch(ref, x, y, 2, "mean")["out"])
    with pytest.raises(dk.InvalidValueError, match="runs 2 times in one forward") as info:
        dk.Pipeline(model, ["cpu", "cpu"], chunks=2, stages=["layers.2"], sample=Call(x, y))
    with dk.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=2, stages=_follow(str(info.value))) as pipe:
        assert torch.equal(pipe(x, y)["out"], _per_micro_batch(ref, x, y, 2, "mean")["out"])
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=2) as pipe:
        assert pipe.plan.parts[1].layer_names[0] == "layers.2"  # no sample: the registered order
        with pytest.raises(dk.SplitError, match=r"ran as stages \[1, 1\].*use chunks=1 or dk.split"):
            pipe(x, y)


def microbatch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("devicekit-microbatch-")]


def test_an_error_in_one_micro_batch_reaches_the_caller_and_the_next_call_works() -> None:
    model, x, y = Stack(), *_batch()
    before = set(microbatch_threads())
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=2, sample=Call(x, y)) as pipe:
        pipe(x, y)["loss"].backward()  # counts the autograd nodes: later calls overlap
        with pytest.raises(RuntimeError):
            pipe(x[:, :3], y)  # the input is one feature short in every micro-batch
        assert torch.isfinite(pipe(x, y)["loss"])
        assert len(set(microbatch_threads()) - before) == 2
    assert not set(microbatch_threads()) - before  # close() stops the micro-batch threads


def test_a_deep_copy_runs_its_own_weights() -> None:
    model, x, y = Stack(), *_batch()
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=2, checkpoint="always", sample=Call(x, y)) as pipe:
        want = pipe(x, y)["out"]
        clone = copy.deepcopy(pipe)
        with torch.no_grad():
            for p in clone.module.parameters():
                p.zero_()
        assert torch.equal(clone(x, y)["out"], torch.zeros_like(want))
        assert torch.equal(pipe(x, y)["out"], want)
        clone.close()


def test_a_traced_pipeline_takes_one_batch() -> None:
    pipe = dk.Pipeline(nn.Sequential(nn.Linear(2, 2)), ["cpu"], chunks=1)
    with pytest.raises(TypeError, match="takes one batch"):
        pipe(torch.randn(1, 2), torch.randn(1, 2))


def test_hf_use_cache_true_is_refused_and_use_cache_false_runs() -> None:
    pytest.importorskip("transformers")
    from tests.modelparallel.hf_models import hf_batch, hf_model

    batch = hf_batch("llama")
    with dk.Pipeline(hf_model("llama"), ["cpu", "cpu"], chunks=2, sample=batch) as pipe:
        with pytest.raises(dk.InvalidValueError, match="use_cache=False"):
            pipe(**batch, use_cache=True)
        assert pipe(**batch, use_cache=False).past_key_values is None


def test_hf_num_items_in_batch_losses_join_as_a_sum() -> None:
    """Hugging Face's Trainer passes the batch's token count: each micro-batch's loss is then its
    sum over that count, and the joined loss is their sum: the whole batch's."""
    pytest.importorskip("transformers")
    from tests.modelparallel.hf_models import hf_batch, hf_model

    model = hf_model("llama")
    ref = copy.deepcopy(model)
    batch = hf_batch("llama")
    count = torch.tensor(batch["labels"][:, 1:].numel())
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=2, sample=batch) as pipe:
        out = pipe(**batch, num_items_in_batch=count)
    whole = ref(**batch, num_items_in_batch=count, use_cache=False)
    torch.testing.assert_close(out.loss, whole.loss)
