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


def tiny_lm() -> nn.Module:
    """A small language model whose head shares the embedding's weight (vocabulary 8000)."""
    embed = nn.Embedding(8000, 256)
    head = nn.Linear(256, 8000, bias=False)
    head.weight = embed.weight
    return nn.Sequential(embed, nn.Linear(256, 256), nn.GELU(), head)


def lm_step(model: nn.Module, tokens):
    """A user's own step: next-token cross-entropy, backward; the logits stay alive (returned)."""
    from torch.nn import functional

    logits = model(tokens[:, :-1])
    loss = functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return logits


def eval_step(model: nn.Module, tokens):
    """A user's eval loop: ``preds = eval_step(model, x)`` keeps the logits and the predictions."""
    logits = model(tokens)
    return logits, logits.argmax(-1)
