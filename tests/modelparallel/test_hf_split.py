"""dk.split agrees with itself on Hugging Face models (issue 35).

Bloom and OPT were refused at 2 devices while 3 worked, BertForMaskedLM said "at most 1" at 2
devices and "at most 2" at 3, Bart was refused at any count: tied units (the embedding and the
head) were counted before they were merged into one group. Now: tie groups are counted, so
whenever k devices can be split every smaller count >= 2 can too, and a refusal's "at most k"
is true (k devices then split). Splits with a keyword batch as the sample give the unsplit
model's loss, logits and gradients bit for bit.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

import devicekit as dk

pytestmark = pytest.mark.usefixtures("torch_one_thread")

pytest.importorskip("transformers")

from tests.modelparallel.hf_models import hf_batch, hf_model, hf_whole  # noqa: E402

ISSUE_CASES = ["bloom", "opt", "bert_mlm", "bart"]


@pytest.mark.parametrize("name", [*ISSUE_CASES, "llama", "gpt_neox"])
def test_every_count_up_to_the_largest_splits_and_at_most_is_true(name: str) -> None:
    batch = hf_batch(name)
    model = hf_model(name)
    counts: list[int] = []
    refusal = ""
    for k in range(2, 12):
        try:
            split = dk.split(model, ["cpu"] * k, sample=batch)
        except dk.SplitError as exc:
            refusal = str(exc)
            break
        counts.append(k)
        model = split.unsplit()
    assert counts and counts[0] == 2 and counts == list(range(2, counts[-1] + 1)), counts
    assert counts[-1] >= 3
    if refusal:  # the largest count it names is one that works
        most = int(re.search(r"at most (\d+) devices", refusal).group(1))
        assert most == counts[-1], refusal


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("name", ISSUE_CASES)
def test_split_with_a_keyword_batch_equals_the_unsplit_model(name: str, devices: int) -> None:
    model = hf_model(name)
    ref = copy.deepcopy(model)
    batch = hf_batch(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    split = dk.split(model, ["cpu"] * devices, sample=batch)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    out, want = hf_whole(split, batch), hf_whole(ref, batch)
    assert torch.equal(out.loss, want.loss) and torch.equal(out.logits, want.logits)
    out.loss.backward()
    want.loss.backward()
    for (pname, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), pname
        assert p.grad is None or torch.equal(p.grad, q.grad), pname


def test_tied_embedding_and_head_share_a_device_at_two_devices() -> None:
    split = dk.split(hf_model("bloom"), ["cpu", "cpu"], sample=hf_batch("bloom"))
    first = split.plan.parts[0]
    assert "lm_head" in first.tied_names and first.layer_names[0] == "transformer.word_embeddings"
    assert len(split.plan.parts) == 2
