"""Hugging Face models through dk.Pipeline at 2 and 3 stages, chunks 1 and 2 (issue 35).

Every family pipelines (none is refused): the model's own forward runs, cut at its blocks, with
keyword batches and ModelOutput results. Against the unsplit model on the same micro-batches,
joined as documented (logits concatenated, loss the mean of the micro-batches' losses), the
loss, the logits and every gradient are equal bit for bit, on the first call (run in the calling
thread) and on the second (micro-batches overlapped in threads). Against the whole batch only
the reduction order differs: a tolerance. Building changes no parameter or buffer.
"""

from __future__ import annotations

import copy

import pytest
import torch

import devicekit as dk

pytestmark = pytest.mark.usefixtures("torch_one_thread")

pytest.importorskip("transformers")

from tests.modelparallel.hf_models import hf_batch, hf_model, hf_reference, hf_whole  # noqa: E402

FAMILIES = ["llama", "gpt_neox", "bert_mlm", "bart", "vit", "convnext", "resnet", "mixtral"]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _grads_equal(model: torch.nn.Module, ref: torch.nn.Module) -> list[str]:
    bad = []
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if (p.grad is None) != (q.grad is None) or (p.grad is not None and not torch.equal(p.grad, q.grad)):
            bad.append(name)
    return bad


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("name", FAMILIES)
def test_hf_pipeline_equals_the_unsplit_model_on_the_same_micro_batches(name: str, stages: int, chunks: int) -> None:
    model = hf_model(name)
    ref = copy.deepcopy(model)
    batch = hf_batch(name)
    before = _state(model)
    with dk.Pipeline(model, ["cpu"] * stages, chunks=chunks, sample=batch) as pipe:
        after = _state(model)
        assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())
        assert len(pipe.plan.parts) == stages
        for step in range(2 if chunks > 1 else 1):  # the first call runs in this thread; the second overlaps
            for p in (*model.parameters(), *ref.parameters()):
                p.grad = None
            out = pipe(**batch)
            loss, logits = hf_reference(ref, batch, chunks)
            assert torch.equal(out.loss, loss), f"step {step}"
            assert torch.equal(out.logits, logits), f"step {step}"
            (out.loss + out.logits.square().mean()).backward()
            (loss + logits.square().mean()).backward()
            assert not _grads_equal(model, ref), f"step {step}: gradients differ: {_grads_equal(model, ref)}"
        assert pipe.last_run is not None and pipe.last_run.microbatches == chunks
    if name == "resnet" and chunks > 1:
        return  # BatchNorm in training mode normalises each micro-batch with its own statistics
    with torch.no_grad():
        whole = hf_whole(ref, batch)
    torch.testing.assert_close(out.logits, whole.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.loss, whole.loss, rtol=1e-4, atol=1e-5)


def test_a_short_last_micro_batch_weighs_its_loss_by_its_size() -> None:
    model = hf_model("llama")
    ref = copy.deepcopy(model)
    batch = hf_batch("llama", n=5)  # micro-batches of 3 and 2 samples
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=2, sample=batch) as pipe:
        out = pipe(**batch)
    loss, logits = hf_reference(ref, batch, 2)
    assert torch.equal(out.loss, loss) and torch.equal(out.logits, logits)
    torch.testing.assert_close(out.loss, hf_whole(copy.deepcopy(ref), batch).loss, rtol=1e-4, atol=1e-5)


def test_positional_and_keyword_inputs_and_eval_without_grad() -> None:
    model = hf_model("gpt_neox")
    ref = copy.deepcopy(model).eval()
    batch = hf_batch("gpt_neox")
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=2) as pipe:  # no sample: checked on the first batch
        pipe.eval()
        with torch.no_grad():
            out = pipe(batch["input_ids"], attention_mask=batch["attention_mask"])
            want = ref(batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-5)
    assert out.loss is None and getattr(out, "past_key_values", None) is None


def test_dropout_with_recompute_runs_in_order_and_replays_the_masks() -> None:
    """Dropout on: micro-batches run one after another in this thread, so the masks are the
    unsplit model's under the same seed, and recomputation replays them (gradients equal)."""
    import transformers as T

    config = T.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=32, max_position_embeddings=64, hidden_dropout_prob=0.2,
                          attention_probs_dropout_prob=0.2)
    torch.manual_seed(0)
    model = T.BertForMaskedLM(config).train()
    ref = copy.deepcopy(model)
    batch = hf_batch("bert_mlm")
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=2, checkpoint="always") as pipe:
        for _ in range(2):
            for p in (*model.parameters(), *ref.parameters()):
                p.grad = None
            torch.manual_seed(5)
            out = pipe(**batch)
            torch.manual_seed(5)
            loss, logits = hf_reference(ref, batch, 2)
            assert torch.equal(out.logits, logits)
            out.loss.backward()
            loss.backward()
            assert not _grads_equal(model, ref)


def test_a_plan_from_split_or_plan_devices_begins_its_stages_where_its_parts_do() -> None:
    model = hf_model("llama")
    ref = copy.deepcopy(model)
    batch = hf_batch("llama")
    plan = dk.split(copy.deepcopy(model), ["cpu", "cpu"], sample=batch).plan
    with dk.Pipeline(model, plan, chunks=2, sample=batch) as pipe:
        assert [p.layer_names[0] for p in pipe.plan.parts] == [p.layer_names[0] for p in plan.parts]
        out = pipe(**batch)
    loss, logits = hf_reference(ref, batch, 2)
    assert torch.equal(out.loss, loss) and torch.equal(out.logits, logits)
