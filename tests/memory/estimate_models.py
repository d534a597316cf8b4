"""Four models the estimate's accuracy is checked on against a peer: torch's own MemTracker.

Shared by tests/memory, tests/gpu and benchmarks/bench_estimate.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from devicekit.memory.losses import cross_entropy_loss
from devicekit.memory.step import LoopOutput, make_optimizer, training_step


class TiedLM(nn.Module):
    """A tiny language model whose output head shares the embedding's weight."""

    def __init__(self, vocab: int = 5000, dim: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mix(self.embed(tokens))))


class CheckpointedMLP(nn.Module):
    """Blocks run under activation checkpointing (non-reentrant)."""

    def __init__(self, dim: int = 512, depth: int = 4, use_checkpoint: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(depth))
        self.use_checkpoint = use_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.use_checkpoint else block(x)
        return x


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )


def transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, dropout=0.1)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


#: name -> (build the model, build a batch of n on a device)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, Any], Any]]] = {
    "mlp": (mlp, lambda n, d="cpu": torch.randn(n, 512, device=d)),
    "cnn-batchnorm": (cnn, lambda n, d="cpu": torch.randn(n, 3, 32, 32, device=d)),
    "transformer": (transformer, lambda n, d="cpu": torch.randn(n, 64, 128, device=d)),
    "tied-embeddings": (TiedLM, lambda n, d="cpu": torch.randint(0, 5000, (n, 32), device=d)),
}


def measured_peak_cpu(model: nn.Module, sample: Any, optimizer: str | None = "adam",
                      precision: str | None = None, steps: int = 2,
                      loss_fn: Callable[[Any, Any], torch.Tensor] = cross_entropy_loss) -> int:
    """The peak bytes of ``steps`` real steps on CPU, by torch's MemTracker (a peer's truth).

    The loop is the one the estimate assumes by default: ``out = model(x)``, the output kept
    until the next step's forward returns (then ``out`` is rebound), cross-entropy over the last
    dimension.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    opt = make_optimizer(optimizer, model.parameters())
    tracker = MemTracker()
    tracker.track_external(model, *([opt] if opt is not None else []))
    with tracker, LoopOutput(model) as last:  # the output lives until the next forward returns
        for _ in range(steps):
            last.keep(training_step(model, sample, opt, precision=precision, loss_fn=loss_fn,
                                    keep_output=True))
            tracker.reset_mod_stats()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def measured_peak_cuda(model: nn.Module, sample: Any, optimizer: str | None = "adam",
                       precision: str | None = None, steps: int = 2,
                       loss_fn: Callable[[Any, Any], torch.Tensor] = cross_entropy_loss) -> tuple[int, int]:
    """(max_memory_allocated, max_memory_reserved) of ``steps`` real steps (model already on cuda).

    The same loop as :func:`measured_peak_cpu`; the first step warms up (cuBLAS handles, state).
    """
    opt = make_optimizer(optimizer, model.parameters())
    with LoopOutput(model) as last:  # the output lives until the next forward returns
        last.keep(training_step(model, sample, opt, precision=precision, loss_fn=loss_fn,
                                keep_output=True))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(steps - 1):
            last.keep(training_step(model, sample, opt, precision=precision, loss_fn=loss_fn,
                                    keep_output=True))
        torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())
