"""Tiny models of every transformers architecture that builds from a shrunk default config.

``tiny_models(task)`` yields ``(model_type, class_name, build, sample)`` for each entry of a
transformers ``AutoModelFor...`` mapping: the architecture's default config with its sizes shrunk
(hidden 32, 2 layers, 2 heads, vocab 512, images 32 px, audio 1,600 samples; nested text/vision/
encoder/decoder configs too), random weights, and a batch of the right kind. Architectures that
do not build that way (a required sub-model, a tokenizer, a size the shrinking breaks) are
reported by the caller as "does not build", not counted against devicekit.

Usage (from a benchmark script)::

    from hf_tiny import TASKS, tiny_models

    for model_type, name, build, sample in tiny_models("causal-lm"):
        model = build()
        batch = sample(4)            # dict of tensors: model(**batch) runs
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: task -> the transformers mapping of model_type -> class name
TASKS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
    "audio-classification": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
}
VOCAB = 512
SEQ = 16
IMAGE = 32
AUDIO = 1600
#: attribute -> small value, set wherever a config has the attribute
SMALL: dict[str, Any] = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "dim": 32, "embed_dim": 32, "n_embed": 32,
    "intermediate_size": 64, "ffn_dim": 64, "d_ff": 64, "n_inner": 64, "hidden_dim": 64,
    "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "d_kv": 16, "head_dim": 16,
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2,
    "encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2,
    "num_attention_heads": 2, "n_head": 2, "n_heads": 2, "num_heads": 2,
    "encoder_attention_heads": 2, "decoder_attention_heads": 2, "num_key_value_heads": 1,
    "vocab_size": VOCAB, "max_position_embeddings": 64, "n_positions": 64,
    "image_size": IMAGE, "patch_size": 8, "num_channels": 3,
    "num_labels": 3, "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "conv_dim": (32, 32), "conv_stride": (5, 2), "conv_kernel": (10, 3),
    "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2,
    "hidden_sizes": [16, 32], "depths": [1, 1], "embed_dims": [16, 32],
    "d_latents": 32, "num_latents": 8, "num_self_attends_per_block": 1,
    "linear_num_heads": 2, "linear_head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
}
NESTED = ("text_config", "vision_config", "encoder", "decoder", "audio_config")


#: per-stage widths of a vision backbone: the first stage narrower, the rest at the small width
_STAGE_WIDTHS = ("hidden_sizes", "embed_dims")


def _fit(default: Any, small: Any, name: str) -> Any:
    """``small`` in the shape the config has for ``name`` (None: keep the default).

    A per-stage list keeps its number of stages (other per-stage lists, such as strides or
    window sizes, must agree with it): depths of 1, widths of 16 then 32, a number where the
    config has a list the same at every stage, a list given whole (Wav2Vec2's conv layers); a
    tuple where the config wants one number is left alone
    (Wav2Vec2's conv sizes against Mamba's ``conv_kernel``)."""
    if isinstance(default, (list, tuple)) and default and all(isinstance(v, int) for v in default):
        stages = len(default)
        if name == "depths":
            return [1] * stages
        if name in _STAGE_WIDTHS:
            return [16] + [32] * (stages - 1)
        return [small] * stages if not isinstance(small, (list, tuple)) else small
    if isinstance(small, (list, tuple)) and default is not None:
        return None
    return small


def tiny_config(config_class: Any) -> Any:
    """``config_class`` made with every :data:`SMALL` size it knows (at construction, so that
    derived fields such as the number of stages agree), nested configs shrunk too."""
    default = config_class()
    small = {}
    for name, value in SMALL.items():
        if hasattr(default, name):
            fitted = _fit(getattr(default, name), value, name)
            if fitted is not None:
                small[name] = fitted
    for name in NESTED:
        inner = getattr(default, name, None)
        if inner is not None and hasattr(inner, "to_dict"):
            small[name] = tiny_config(type(inner)).to_dict()
    if hasattr(default, "use_cache"):
        small["use_cache"] = False
    for token in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = getattr(default, token, None)
        if isinstance(value, int) and value >= VOCAB:
            small[token] = 0
    try:
        return config_class(**small)
    except Exception:  # some sizes are checked against each other: fall back to setting them
        for name, value in small.items():
            if name not in NESTED:
                setattr(default, name, value)
        return default


def _sample(task: str, config: Any) -> Callable[[int], dict[str, torch.Tensor]]:
    vocab = min(getattr(config, "vocab_size", VOCAB) or VOCAB, VOCAB)

    def text(n: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(1, vocab, (n, SEQ))}

    if task in ("causal-lm", "masked-lm"):
        return text
    if task == "seq2seq":
        return lambda n: {"input_ids": torch.randint(1, vocab, (n, SEQ)),
                          "decoder_input_ids": torch.randint(1, vocab, (n, SEQ))}
    if task == "image-classification":
        channels = getattr(config, "num_channels", 3) or 3
        return lambda n: {"pixel_values": torch.randn(n, channels, IMAGE, IMAGE)}
    return lambda n: {"input_values": torch.randn(n, AUDIO)}


def labels_for(task: str, model: Any, batch: dict[str, torch.Tensor]) -> Any:
    """Labels that the model's own loss accepts for ``batch`` (``model(**batch, labels=...)``)."""
    n = next(iter(batch.values())).shape[0]
    if task in ("causal-lm", "masked-lm"):
        return batch["input_ids"]
    if task == "seq2seq":
        return batch["decoder_input_ids"]
    if task in ("image-classification", "audio-classification"):
        return torch.randint(0, 3, (n,))
    return torch.randint(1, 8, (n, 4))  # ctc: short transcripts


def tiny_models(task: str) -> Iterator[tuple[str, str, Callable[[], Any], Callable[[int], Any]]]:
    """``(model_type, class name, build, sample)`` for every architecture of ``task``."""
    import transformers
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    mapping = getattr(modeling_auto, TASKS[task])
    for model_type, class_name in sorted(mapping.items()):
        if isinstance(class_name, (list, tuple)):
            class_name = class_name[0]

        def build(model_type: str = model_type, class_name: str = class_name) -> Any:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = tiny_config(CONFIG_MAPPING[model_type])
                if task in ("image-classification", "audio-classification"):
                    config.num_labels = 3
                model = getattr(transformers, class_name)(config)
            return model.train()

        def sample(n: int, model_type: str = model_type) -> Any:
            return _sample(task, tiny_config(CONFIG_MAPPING[model_type]))(n)

        yield model_type, class_name, build, sample
