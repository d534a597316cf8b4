"""A zoo of the models people train, tiny, for dk.split and dk.Pipeline (tests/modelparallel/test_pipeline_zoo.py).

Each entry builds a seeded model and a batch. None of these models was written for devicekit:
a UNet with skips joined by ``torch.cat([...])``, a ViT with a cls token and a positional
parameter, an LSTM returning ``h_n`` (batch on dimension 1), GRUs on a ``PackedSequence``,
MultiheadAttention with a causal and a padding mask, dict outputs with keyword inputs, in-place
ops across cuts, a no-grad (stop-gradient) target branch, buffers written in forward, control
flow on values, a submodule called twice, a far tie, a GPT with tied embeddings, a ResNet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from tests.modelparallel.any_models import GPT, ResNet


class UNet(nn.Module):
    """Two levels down, two up; skips joined with torch.cat of a list; GroupNorm."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()

        def conv(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.SiLU())

        self.down1 = conv(3, c)
        self.down2 = conv(c, 2 * c)
        self.mid = conv(2 * c, 2 * c)
        self.up2 = conv(4 * c, c)
        self.up1 = conv(2 * c, c)
        self.out = nn.Conv2d(c, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        m = self.mid(F.max_pool2d(d2, 2))
        u2 = self.up2(torch.cat([F.interpolate(m, scale_factor=2.0), d2], dim=1))
        u1 = self.up1(torch.cat([F.interpolate(u2, scale_factor=2.0), d1], dim=1))
        return self.out(u1)


class ViTBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    """Patch embedding, a cls token and a positional nn.Parameter joined with torch.cat."""

    def __init__(self, dim: int = 16, depth: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 5, dim) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.size(0), -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class LSTMTagger(nn.Module):
    """Embedding, a 2-layer LSTM, a head; returns the logits and h_n (batch on dimension 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.lstm = nn.LSTM(8, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, 4)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, (h_n, _c_n) = self.lstm(self.embed(tokens))
        return self.head(out), h_n


class PackedGRU(nn.Module):
    """Two GRUs on a PackedSequence (the packed output of one feeds the next), head on h_n[-1]."""

    def __init__(self) -> None:
        super().__init__()
        self.gru1 = nn.GRU(6, 10, batch_first=True)
        self.gru2 = nn.GRU(10, 10, batch_first=True)
        self.head = nn.Linear(10, 3)

    def forward(self, packed: PackedSequence) -> torch.Tensor:
        mid, _ = self.gru1(packed)
        _, h_n = self.gru2(mid)
        return self.head(h_n[-1])


class MaskedAttention(nn.Module):
    """MultiheadAttention with a causal attn_mask and a key_padding_mask from the batch."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(6, dim)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.head = nn.Linear(dim, 2)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, pad = batch
        h = self.proj(x)
        t = x.size(1)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        h, _ = self.attn(h, h, h, attn_mask=causal, key_padding_mask=pad, need_weights=False)
        return self.head(h)


class DictOut(nn.Module):
    """Keyword inputs with defaults; a dict of outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 12), nn.Tanh())
        self.decoder = nn.Linear(12, 6)
        self.classifier = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 2.0,
                return_hidden: bool = True) -> dict[str, torch.Tensor]:
        h = self.encoder(x)
        if mask is not None:
            h = h * mask
        out = {"recon": self.decoder(h) * scale, "logits": self.classifier(h)}
        if return_hidden:
            out["hidden"] = h
        return out


class InPlace(nn.Module):
    """In-place ops in the parent's forward, on values that cross cuts."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = h.relu_()
        g = self.b(h)
        g += h
        g.mul_(0.5)
        return self.c(F.relu(g, inplace=True))


def inplace_sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True),
                         nn.Linear(8, 3))


class StopGradTarget(nn.Module):
    """A target network run under no_grad (BYOL-style) and a head on a detached value."""

    def __init__(self) -> None:
        super().__init__()
        self.online = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        self.predictor = nn.Linear(8, 8)
        self.target = nn.Linear(6, 8)
        self.probe = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.predictor(self.online(x))
        with torch.no_grad():
            t = self.target(x)
        return p * t, self.probe(p.detach())


class Counting(nn.Module):
    """Buffers written in forward: a step counter and a running count of samples."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        self.seen.add_(x.size(0))
        return self.b(torch.tanh(self.a(x)))


class ValueControlFlow(nn.Module):
    """An if on a tensor's value in the model's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        return self.b(h)


class Gated(nn.Module):
    """Control flow on values inside a submodule (a unit): the parent's forward traces."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) if bool(x.mean() > 0) else -self.lin(x)


class InnerControlFlow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.gate = Gated()
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.gate(self.a(x)))


class CalledTwice(nn.Module):
    """One submodule called twice, with another in between."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.shared = nn.Linear(8, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(self.inp(x)))
        h = torch.tanh(self.shared(self.mid(h)))
        return self.out(h)


class FarTie(nn.Module):
    """The first layer's weight reused, transposed, by the last (an autoencoder's tied decoder)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 8)
        self.mid1 = nn.Linear(8, 8)
        self.mid2 = nn.Linear(8, 8)
        self.dec_bias = nn.Parameter(torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.enc(x))
        h = torch.tanh(self.mid2(torch.tanh(self.mid1(h))))
        return F.linear(h, self.enc.weight.t(), self.dec_bias)


def _packed(n: int) -> PackedSequence:
    x = torch.randn(n, 5, 6)
    lengths = torch.tensor([5 - (i % 4) for i in range(n)])
    return pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)


@dataclass(frozen=True)
class ZooEntry:
    build: Callable[[], nn.Module]
    batch: Callable[[int], object]
    #: why the pipeline refuses it (a regex of the message), or None when it must match unsplit
    refused: str | None = None
    #: refused only with more than one micro-batch
    refused_chunks: int = 1


ZOO: dict[str, ZooEntry] = {
    "unet": ZooEntry(UNet, lambda n: torch.randn(n, 3, 8, 8)),
    "vit": ZooEntry(ViT, lambda n: torch.randn(n, 3, 8, 8)),
    "lstm": ZooEntry(LSTMTagger, lambda n: torch.randint(0, 20, (n, 7))),
    "packed_gru": ZooEntry(PackedGRU, _packed),
    "masked_attention": ZooEntry(MaskedAttention, lambda n: (torch.randn(n, 5, 6), torch.arange(5) >= 5 - (
        torch.arange(n) % 3).unsqueeze(1))),
    "dict_out": ZooEntry(DictOut, lambda n: torch.randn(n, 6)),
    "in_place": ZooEntry(InPlace, lambda n: torch.randn(n, 6)),
    "in_place_sequential": ZooEntry(inplace_sequential, lambda n: torch.randn(n, 6)),
    "stop_grad_target": ZooEntry(StopGradTarget, lambda n: torch.randn(n, 6)),
    "counting": ZooEntry(Counting, lambda n: torch.randn(n, 6), refused=r"buffer 'steps'.*written", refused_chunks=2),
    "value_control_flow": ZooEntry(ValueControlFlow, lambda n: torch.randn(n, 6),
                                   refused=r"ValueControlFlow.*does not trace"),
    "inner_control_flow": ZooEntry(InnerControlFlow, lambda n: torch.randn(n, 6)),
    "called_twice": ZooEntry(CalledTwice, lambda n: torch.randn(n, 6)),
    "far_tie": ZooEntry(FarTie, lambda n: torch.randn(n, 6)),
    "gpt": ZooEntry(lambda: GPT(depth=2, context=8), lambda n: torch.randint(0, 50, (n, 8))),
    "resnet": ZooEntry(lambda: ResNet(width=4), lambda n: torch.randn(n, 3, 8, 8)),
}


def zoo_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return ZOO[name].build()


def zoo_batch(name: str, n: int = 8) -> object:
    torch.manual_seed(1)
    return ZOO[name].batch(n)
