"""Hugging Face transformers models the estimate is held to: tiny configs, random weights.

``HF_ZOO[name] = HFCase(build, sample(batch), labels(batch), batch)``: ``build()`` makes the
model in training mode, ``sample(n)`` a batch of keyword arguments (``model(**batch)`` runs),
``labels(batch)`` what the model's own loss takes (``model(**batch, labels=...)``), ``batch``
the size the tests use. Decoder LMs (tied and untied embeddings), an encoder MLM, encoder-
decoders (T5, Bart, Whisper), a vision transformer, two convnets, a mixture of experts with
transformers' default grouped experts (torch's fake ``_grouped_mm`` accepts only bf16) and a
CTC speech model with its default LayerDrop and SpecAugment (shapes that depend on values).
Shared by tests/memory/test_estimate_hf.py and benchmarks/bench_estimate_hf.py.

Usage::

    from tests.memory.hf_zoo import HF_ZOO, hf_step

    case = HF_ZOO["t5"]
    model, batch = case.build(), case.sample(case.batch)
    hf_step(case)(model, batch)          # model(**batch, labels=...).loss.backward()
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

VOCAB = 1000
SEQ = 32


@dataclass(frozen=True)
class HFCase:
    build: Callable[[], torch.nn.Module]
    sample: Callable[[int], dict[str, torch.Tensor]]
    labels: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    batch: int = 4


def _tf() -> Any:
    import transformers

    return transformers


def _quiet(make: Callable[[], torch.nn.Module]) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return make().train()
    return build


def _tokens(n: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB, (n, SEQ))}


def _seq2seq(n: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB, (n, SEQ)),
            "decoder_input_ids": torch.randint(0, VOCAB, (n, SEQ))}


def _image(n: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(n, 3, 32, 32)}


def _classes(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.randint(0, 10, (next(iter(batch.values())).shape[0],))


def _transcripts(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.randint(1, 8, (batch["input_values"].shape[0], 4))


_SMALL = {"num_hidden_layers": 2, "num_attention_heads": 2}
_ENC_DEC = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2,
            "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
            "vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0,
            "decoder_start_token_id": 0}


def _cases() -> dict[str, HFCase]:
    tf = _tf()
    return {
        "gpt2": HFCase(_quiet(lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
            n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=64,
            bos_token_id=0, eos_token_id=0))), _tokens, lambda b: b["input_ids"]),
        "qwen2-tied": HFCase(_quiet(lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(
            hidden_size=32, num_key_value_heads=1, intermediate_size=64, vocab_size=VOCAB,
            tie_word_embeddings=True, **_SMALL))), _tokens, lambda b: b["input_ids"]),
        "bert-mlm": HFCase(_quiet(lambda: tf.BertForMaskedLM(tf.BertConfig(
            hidden_size=32, intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
            **_SMALL))), _tokens, lambda b: b["input_ids"]),
        "opt": HFCase(_quiet(lambda: tf.OPTForCausalLM(tf.OPTConfig(
            hidden_size=32, ffn_dim=64, vocab_size=VOCAB, word_embed_proj_dim=32,
            max_position_embeddings=64, **_SMALL))), _tokens, lambda b: b["input_ids"]),
        "t5": HFCase(_quiet(lambda: tf.T5ForConditionalGeneration(tf.T5Config(
            d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
            vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0))),
            _seq2seq, lambda b: b["decoder_input_ids"]),
        "bart": HFCase(_quiet(lambda: tf.BartForConditionalGeneration(tf.BartConfig(
            max_position_embeddings=64, **_ENC_DEC))), _seq2seq, lambda b: b["decoder_input_ids"]),
        "whisper": HFCase(_quiet(lambda: tf.WhisperForConditionalGeneration(tf.WhisperConfig(
            num_mel_bins=16, max_source_positions=32, max_target_positions=64, **_ENC_DEC))),
            lambda n: {"input_features": torch.randn(n, 16, 64),
                       "decoder_input_ids": torch.randint(0, VOCAB, (n, 16))},
            lambda b: b["decoder_input_ids"]),
        "vit": HFCase(_quiet(lambda: tf.ViTForImageClassification(tf.ViTConfig(
            hidden_size=32, intermediate_size=64, image_size=32, patch_size=8, num_labels=10,
            **_SMALL))), _image, _classes, batch=8),
        "resnet": HFCase(_quiet(lambda: tf.ResNetForImageClassification(tf.ResNetConfig(
            embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10))),
            _image, _classes, batch=8),
        "convnext": HFCase(_quiet(lambda: tf.ConvNextForImageClassification(tf.ConvNextConfig(
            num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10, image_size=32))),
            _image, _classes, batch=8),
        # transformers' default experts (grouped_mm): torch's meta kernel takes only bf16, the
        # real fp32 CPU one runs (devicekit sizes it from its shapes: real_kernels)
        "mixtral": HFCase(_quiet(lambda: tf.MixtralForCausalLM(tf.MixtralConfig(
            hidden_size=32, intermediate_size=64, num_key_value_heads=1, num_local_experts=4,
            num_experts_per_tok=2, vocab_size=VOCAB, **_SMALL))),
            _tokens, lambda b: b["input_ids"], batch=16),
        # default LayerDrop 0.1 and SpecAugment masking: shapes depend on values
        "wav2vec2-ctc": HFCase(_quiet(lambda: tf.Wav2Vec2ForCTC(tf.Wav2Vec2Config(
            hidden_size=32, intermediate_size=64, conv_dim=(32, 32), conv_stride=(5, 2),
            conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
            vocab_size=32, **_SMALL))),
            lambda n: {"input_values": torch.randn(n, 1600)}, _transcripts, batch=8),
    }


HF_ZOO: dict[str, HFCase] = _cases()


def hf_step(case: HFCase) -> Callable[[torch.nn.Module, Any], Any]:
    """The Hugging Face loop: ``out = model(**batch, labels=...)``, ``out.loss.backward()``;
    the output is returned (a loop keeps ``out`` until the next forward returns)."""
    def step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        out = model(**batch, labels=case.labels(batch))
        out.loss.backward()
        return out

    return step

