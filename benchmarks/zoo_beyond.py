"""Models beyond transformers' own heads, for the estimate's sweep: diffusers' UNets and VAEs
from tiny configs (every 2-D down/up block type), PEFT LoRA, gradient checkpointing (Hugging
Face, diffusers, by hand), a DLRM-like recommender on sparse tables, eval loops, and
torchvision's model registry where a CPU build of torchvision is installed.

``cases()`` yields :class:`Case` rows: a name, a family, ``build()`` (a model), ``sample(n)``
(a batch of n), and how to size it (optimizer, loss, ``step``, ``training``).

Usage (from a benchmark script)::

    from zoo_beyond import cases

    for case in cases():
        model, batch = case.build(), case.sample(4)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional

__all__ = ["Case", "cases", "torchvision_unavailable"]


@dataclass
class Case:
    name: str
    family: str
    build: Callable[[], nn.Module]
    sample: Callable[[int], Any]
    kwargs: dict[str, Any] = field(default_factory=dict)    # estimate_memory's: optimizer, loss_fn, step, training


def _image(n: int, size: int = 16, channels: int = 3) -> torch.Tensor:
    return torch.randn(n, channels, size, size)


def _denoise(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """A diffusion step's own loss: mse of the predicted noise against the noise."""
    out = model(**batch).sample
    functional.mse_loss(out, batch["sample"]).backward()
    return out


def _vae_step(model: nn.Module, x: torch.Tensor) -> Any:
    """A VAE's own loss: reconstruction plus KL, through a sampled latent."""
    posterior = model.encode(x).latent_dist
    rebuilt = model.decode(posterior.sample()).sample
    (functional.mse_loss(rebuilt, x) + posterior.kl().mean()).backward()
    return rebuilt


_UNET_BLOCKS = [  # (down, up) pairs of diffusers' 2-D blocks that a UNet2DModel accepts
    (("DownBlock2D", "DownBlock2D"), ("UpBlock2D", "UpBlock2D")),
    (("DownBlock2D", "AttnDownBlock2D"), ("AttnUpBlock2D", "UpBlock2D")),
    (("ResnetDownsampleBlock2D", "ResnetDownsampleBlock2D"), ("ResnetUpsampleBlock2D", "ResnetUpsampleBlock2D")),
    (("SkipDownBlock2D", "AttnSkipDownBlock2D"), ("AttnSkipUpBlock2D", "SkipUpBlock2D")),
    (("KDownBlock2D", "KDownBlock2D"), ("KUpBlock2D", "KUpBlock2D")),
]
_CONDITIONED = [  # UNet2DConditionModel's cross-attention blocks
    (("CrossAttnDownBlock2D", "DownBlock2D"), ("UpBlock2D", "CrossAttnUpBlock2D"), "UNetMidBlock2DCrossAttn"),
    (("SimpleCrossAttnDownBlock2D", "ResnetDownsampleBlock2D"), ("ResnetUpsampleBlock2D", "SimpleCrossAttnUpBlock2D"),
     "UNetMidBlock2DSimpleCrossAttn"),
]


def _diffusers() -> Iterator[Case]:
    from diffusers import AutoencoderKL, AutoencoderTiny, UNet2DConditionModel, UNet2DModel, VQModel

    for down, up in _UNET_BLOCKS:
        def unet(down: tuple[str, ...] = down, up: tuple[str, ...] = up) -> nn.Module:
            return UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                               block_out_channels=(32, 64), down_block_types=down, up_block_types=up,
                               norm_num_groups=8, attention_head_dim=8)

        def batch(n: int) -> dict[str, torch.Tensor]:
            return {"sample": _image(n), "timestep": torch.randint(0, 1000, (n,))}

        name = f"UNet2D {'+'.join(down)}"
        yield Case(name, "diffusers", unet, batch, {"loss_fn": "mse"})
        yield Case(name, "diffusers", unet, batch, {"step": _denoise})

    for down, up, mid in _CONDITIONED:
        def cond(down: tuple[str, ...] = down, up: tuple[str, ...] = up, mid: str = mid,
                 checkpointed: bool = False) -> nn.Module:
            model = UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                                         block_out_channels=(32, 64), down_block_types=down, up_block_types=up,
                                         mid_block_type=mid, cross_attention_dim=32, attention_head_dim=8,
                                         norm_num_groups=8)
            if checkpointed:
                model.enable_gradient_checkpointing()
            return model

        def text_batch(n: int) -> dict[str, torch.Tensor]:
            return {"sample": _image(n, 16, 4), "timestep": torch.randint(0, 1000, (n,)),
                    "encoder_hidden_states": torch.randn(n, 8, 32)}

        name = f"UNet2DCondition {down[0]}"
        yield Case(name, "diffusers", cond, text_batch, {"step": _denoise})
        yield Case(f"{name}, gradient checkpointing", "checkpointing",
                   lambda cond=cond: cond(checkpointed=True), text_batch, {"step": _denoise})
        yield Case(f"{name}, eval", "eval loop", cond, text_batch, {"training": False})

    def vae(checkpointed: bool = False) -> nn.Module:
        model = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(32, 64), latent_channels=4,
                              down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                              norm_num_groups=8, layers_per_block=1)
        if checkpointed:
            model.enable_gradient_checkpointing()
        return model

    yield Case("AutoencoderKL", "diffusers", vae, _image, {"loss_fn": "mse"})
    yield Case("AutoencoderKL, own loss", "diffusers", vae, _image, {"step": _vae_step})
    yield Case("AutoencoderKL, gradient checkpointing", "checkpointing", lambda: vae(True), _image, {"step": _vae_step})
    yield Case("AutoencoderKL, eval", "eval loop", vae, _image, {"training": False})
    yield Case("AutoencoderTiny", "diffusers",
               lambda: AutoencoderTiny(encoder_block_out_channels=(16, 16), decoder_block_out_channels=(16, 16),
                                       num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1), latent_channels=4),
               _image, {"loss_fn": "mse"})
    yield Case("VQModel", "diffusers",
               lambda: VQModel(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
                               up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8,
                               num_vq_embeddings=64, layers_per_block=1),
               _image, {"loss_fn": "mse"})


def _gpt2(checkpointed: bool = False) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64))
    if checkpointed:
        model.gradient_checkpointing_enable()
        model.train()
    return model


def _tokens(n: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 512, (n, 32))}


def _lm_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    return out


def _peft_and_checkpointing() -> Iterator[Case]:
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertForMaskedLM

    def lora_gpt2() -> nn.Module:
        return get_peft_model(_gpt2(), LoraConfig(r=8, target_modules=["c_attn"], task_type="CAUSAL_LM"))

    def lora_bert() -> nn.Module:
        bert = BertForMaskedLM(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, vocab_size=512, max_position_embeddings=64))
        return get_peft_model(bert, LoraConfig(r=4, target_modules=["query", "value"]))

    def lora_unet() -> nn.Module:
        from diffusers import UNet2DConditionModel

        unet = UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                                    block_out_channels=(32, 64), cross_attention_dim=32, attention_head_dim=8,
                                    norm_num_groups=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
        return get_peft_model(unet, LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v"]))

    def unet_batch(n: int) -> dict[str, torch.Tensor]:
        return {"sample": _image(n, 16, 4), "timestep": torch.randint(0, 1000, (n,)),
                "encoder_hidden_states": torch.randn(n, 8, 32)}

    def unet_lora_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        out = model.base_model.model(**batch).sample
        functional.mse_loss(out, batch["sample"]).backward()
        return out

    yield Case("GPT-2 + LoRA", "peft", lora_gpt2, _tokens, {})
    yield Case("GPT-2 + LoRA, own loss", "peft", lora_gpt2, _tokens, {"step": _lm_step})
    yield Case("BERT MLM + LoRA", "peft", lora_bert, _tokens, {})
    yield Case("UNet2DCondition + LoRA", "peft", lora_unet, unet_batch, {"step": unet_lora_step})
    yield Case("GPT-2, gradient checkpointing", "checkpointing", lambda: _gpt2(True), _tokens, {"step": _lm_step})
    yield Case("GPT-2, eval", "eval loop", _gpt2, _tokens, {"training": False})

    class HandCheckpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
                                        for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            return x

    yield Case("MLP, torch.utils.checkpoint by hand", "checkpointing", HandCheckpointed,
               lambda n: torch.randn(n, 64, 256), {"loss_fn": "mse"})


def _recommenders() -> Iterator[Case]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.memory.recommender import Recommender, recommender_batch

    for optimizer in ("sgd", "adagrad"):
        yield Case(f"DLRM-like, sparse tables, {optimizer}", "recommender", Recommender,
                   lambda n: recommender_batch(64 * n), {"optimizer": optimizer, "loss_fn": "mse"})
    yield Case("EmbeddingBag 200k x 64, sparse-adam", "recommender",
               lambda: nn.EmbeddingBag(200_000, 64, mode="sum", sparse=True),
               lambda n: torch.randint(0, 200_000, (256 * n, 64)), {"optimizer": "sparse-adam", "loss_fn": "sum"})
    yield Case("DLRM-like, dense tables, adam", "recommender", lambda: Recommender(sparse=False),
               lambda n: recommender_batch(64 * n), {"loss_fn": "mse"})


def torchvision_unavailable() -> str | None:
    """Why torchvision's registry is not swept here (None: it is)."""
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # the PyPI wheel is CUDA-built: its ops need libtorch_cuda
        return f"torchvision does not import with this torch ({type(exc).__name__}: {str(exc)[:80]})"
    return None


def _torchvision() -> Iterator[Case]:
    if torchvision_unavailable() is not None:
        return
    import torchvision

    for name in torchvision.models.list_models(module=torchvision.models):
        def build(name: str = name) -> nn.Module:
            return torchvision.models.get_model(name, weights=None, num_classes=10)

        size = 224 if any(k in name for k in ("vit", "swin", "maxvit")) else 64
        yield Case(f"torchvision {name}", "torchvision", build, lambda n, size=size: _image(n, size), {})


def cases() -> Iterator[Case]:
    """Every case, family by family (a family whose library is missing is left out)."""
    warnings.filterwarnings("ignore")
    for family in (_diffusers, _peft_and_checkpointing, _recommenders, _torchvision):
        try:
            yield from family()
        except ImportError as exc:
            print(f"{family.__name__.strip('_')}: not installed ({exc})")
