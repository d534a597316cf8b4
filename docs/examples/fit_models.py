"""Model factories the "Will it fit?" page runs `devicekit estimate` / `advise` on."""

from torch import nn


def small_mlp() -> nn.Module:
    """About 8 M parameters: fits anywhere."""
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])


def wide_mlp() -> nn.Module:
    """About 1 B parameters, built on the meta device (no memory): 16 GiB of Adam state alone."""
    import torch

    with torch.device("meta"):
        return nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(16)])
