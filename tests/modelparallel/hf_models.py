"""Tiny Hugging Face transformers models for the model-parallel tests: random weights, dropout 0.

Hidden sizes 16, 2-4 blocks, vocabulary 100: built from configs offline, in milliseconds. Each
family the issue names: Llama-style and GPT-NeoX-style decoders with tied embeddings, an encoder
MLM (BERT), an encoder-decoder (BART), a vision transformer (ViT), convnets (ConvNeXt with
LayerNorm, ResNet with BatchNorm), a mixture of experts (Mixtral), and Bloom and OPT (the
issue's split cases).

Usage::

    model = hf_model("llama")              # seeded: the same weights every call
    batch = hf_batch("llama", n=4)         # {"input_ids", "attention_mask", "labels"}
    loss, logits = hf_reference(copy.deepcopy(model), batch, chunks=2)   # unsplit, per micro-batch
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

VOCAB = 100
VISION = {"vit": 16, "convnext": 32, "resnet": 32, "swin": 32}


def _builders() -> dict[str, Callable[[], nn.Module]]:
    import transformers as T

    no_drop = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    return {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=64)),
        "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
            tie_word_embeddings=True, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)),
        "bert_mlm": lambda: T.BertForMaskedLM(T.BertConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=64, **no_drop)),
        "bart": lambda: T.BartForConditionalGeneration(T.BartConfig(
            vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)),
        "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)),
        "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(
            vocab_size=VOCAB, hidden_size=16, n_layer=3, n_head=2, hidden_dropout=0.0, attention_dropout=0.0)),
        "opt": lambda: T.OPTForCausalLM(T.OPTConfig(
            vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, ffn_dim=32,
            word_embed_proj_dim=16, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)),
        "vit": lambda: T.ViTForImageClassification(T.ViTConfig(
            hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32, image_size=16,
            patch_size=4, num_labels=5, **no_drop)),
        "convnext": lambda: T.ConvNextForImageClassification(T.ConvNextConfig(
            hidden_sizes=[8, 16, 16], depths=[1, 1, 1], num_stages=3, image_size=32, num_labels=5)),
        "resnet": lambda: T.ResNetForImageClassification(T.ResNetConfig(
            embedding_size=8, hidden_sizes=[8, 16, 16], depths=[1, 1, 1], layer_type="basic", num_labels=5)),
    }


def hf_model(name: str) -> nn.Module:
    """The tiny ``name`` model, same weights every call (seeded), in training mode."""
    torch.manual_seed(0)
    model = _builders()[name]()
    model.train()
    return model


def hf_batch(name: str, n: int = 4, length: int = 8) -> dict[str, torch.Tensor]:
    """A keyword batch for ``name``: token ids, mask and labels, or pixels and class labels."""
    g = torch.Generator().manual_seed(1)
    if name in VISION:
        size = VISION[name]
        return {"pixel_values": torch.randn(n, 3, size, size, generator=g),
                "labels": torch.randint(0, 5, (n,), generator=g)}
    ids = torch.randint(0, VOCAB, (n, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _call(model: nn.Module, batch: dict[str, Any]) -> Any:
    extra = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    return model(**batch, **extra)


def hf_reference(model: nn.Module, batch: dict[str, torch.Tensor], chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsplit model on the same micro-batches (each tensor cut along dimension 0), joined as
    a pipeline documents: logits concatenated, loss the size-weighted mean of the losses."""
    pieces = {k: v.chunk(chunks) for k, v in batch.items()}
    count = len(next(iter(pieces.values())))
    outs = [_call(model, {k: v[i] for k, v in pieces.items()}) for i in range(count)]
    losses = torch.stack([o.loss for o in outs])
    sizes = [len(p) for p in next(iter(pieces.values()))]
    if count == 1:
        loss = outs[0].loss
    elif len(set(sizes)) == 1:
        loss = losses.mean()
    else:
        loss = (losses * torch.tensor([b / sum(sizes) for b in sizes], dtype=losses.dtype)).sum()
    return loss, torch.cat([o.logits for o in outs])


def hf_whole(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """The unsplit model on the whole batch."""
    return _call(model, batch)
