"""Non-Sequential models for dk.split: the seeds' Net, a small ResNet, a tied-embedding GPT, kwargs."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


class Net(nn.Module):
    """The seeds' model-parallel example, without the hand-written .cuda(i) calls."""

    def __init__(self) -> None:
        super().__init__()
        self.sub_network1 = nn.Linear(100, 32)
        self.sub_network2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.sub_network1(x)
        return self.sub_network2(x)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.down(x)          # skip connection (in place)
        return F.relu(out)


class ResNet(nn.Module):
    """ResNet-style CNN: stem, 2 stages of 2 blocks, pooling, head; a skip over a whole stage."""

    def __init__(self, width: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x)))
        x = x + self.layer1(x)       # a skip in the parent's own forward, across units
        x = self.layer2(x)
        return self.fc(torch.flatten(self.pool(x), 1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-style: token embedding tied to the head, a positional nn.Parameter of the model itself,
    blocks called with a keyword mask, final norm."""

    def __init__(self, vocab: int = 50, dim: int = 32, depth: int = 4, heads: int = 4, context: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, context, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input/output embeddings

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        x = self.wte(idx) + self.pos[:, :t]
        # the causal mask built from the model's own tensor: torch.full(..., device=idx.device)
        # does not trace with torch.fx before torch 2.9, and Pipeline traces this forward
        row = torch.zeros_like(self.pos[0, :t, 0])
        mask = (row.unsqueeze(0) + row.unsqueeze(1)).masked_fill(
            torch.ones_like(row.unsqueeze(0) + row.unsqueeze(1), dtype=torch.bool).triu(1), float("-inf"))
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.lm_head(self.ln_f(x))


class TwoTower(nn.Module):
    """Nested dict input, keyword arguments, branches joined with torch.cat in the parent."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(6, 8)
        self.right = Gate()
        self.head = nn.Linear(16, 3)

    def forward(self, batch: dict[str, object], scale: float = 1.0) -> torch.Tensor:
        a = self.left(batch["x"])
        b = self.right(batch["pair"], bias=batch["bias"])
        return self.head(torch.cat([a, b], dim=1)) * scale


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 8)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor], *, bias: torch.Tensor) -> torch.Tensor:
        u, v = pair
        return self.proj(u) * torch.sigmoid(self.proj(v)) + bias


def two_tower_batch(n: int = 8) -> dict[str, object]:
    torch.manual_seed(2)
    return {"x": torch.randn(n, 6), "pair": (torch.randn(n, 6), torch.randn(n, 6)), "bias": torch.randn(8)}


def _seeded(cls: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return cls()
    return build


ANY_MODELS: dict[str, Callable[[], nn.Module]] = {
    "net": _seeded(Net), "resnet": _seeded(ResNet), "gpt": _seeded(GPT), "two_tower": _seeded(TwoTower),
}


def any_sample(name: str, batch: int = 8) -> object:
    torch.manual_seed(1)
    if name == "net":
        return torch.randn(batch, 100)
    if name == "resnet":
        return torch.randn(batch, 3, 8, 8)
    if name == "gpt":
        return torch.randint(0, 50, (batch, 12))
    return two_tower_batch(batch)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out.float() ** 2).mean() + out.float().sum() * 0.01


def twin(factory: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    model = factory()
    return model, copy.deepcopy(model)
