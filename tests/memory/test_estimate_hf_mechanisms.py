"""Mechanisms found by the sweep over every transformers architecture (issue 34,
``benchmarks/sweep_estimate_hf.py``), each pinned with a small model: what made an estimate, or
the truth it is checked against, wrong for a whole family of architectures."""

from __future__ import annotations

import torch
from torch import nn

import devicekit as dk
from devicekit.memory.losses import cross_entropy_loss
from tests.memory.memory_truth import measured_peak


class LayerDropNet(nn.Module):
    """``if torch.rand([]) < p: continue`` over its layers, as Wav2Vec2, HuBERT, SeamlessM4T and
    NLLB-MoE do in training (LayerDrop)."""

    def __init__(self, layerdrop: float, width: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.layerdrop = layerdrop
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            x = torch.relu(layer(x))
        return self.head(x)


def test_truth_of_a_layerdrop_model_is_the_step_where_every_layer_runs() -> None:
    # the sweep read Wav2Vec2 CTC +35 %, HuBERT +64 % "over" and SeamlessM4T -5 % "under":
    # each single real step of the truth dropped a random set of layers, while a loop's peak
    # is the step that drops none (the estimate's answer)
    x = torch.randn(32, 64)
    torch.manual_seed(0)
    full = LayerDropNet(0.0)
    dropping = LayerDropNet(0.9)
    dropping.load_state_dict(full.state_dict())
    every_layer = measured_peak(full, x, loss_fn=cross_entropy_loss)
    for seed in range(3):
        torch.manual_seed(seed)
        assert measured_peak(dropping, x, loss_fn=cross_entropy_loss) == every_layer
    est = dk.estimate_memory(dropping, x, device="cpu")
    assert abs(est.peak / every_layer - 1) <= 0.02, (est.peak, every_layer, est.method)


class StatefulNet(nn.Module):
    """Keeps its last hidden state in a plain attribute, as RecurrentGemma keeps
    ``recurrent_states``: after a training step it is a non-leaf tensor of the last graph."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.head = nn.Linear(width, 10)
        self.state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(x))
        self.state = h[:, :8]
        return self.head(h)


def test_a_model_holding_state_from_its_last_step_is_estimated_not_refused() -> None:
    # the sweep: RecurrentGemma's own loss was refused, blaming the sample ("failed on the
    # sample ... Only Tensors created explicitly by the user (graph leaves) support the
    # deepcopy protocol"): neither the fake copy nor the real steps could copy the model once
    # it had trained; a plain tensor attribute alone sent every such model to real steps
    torch.manual_seed(0)
    model, x = StatefulNet(), torch.randn(16, 64)
    model(x).sum().backward()                      # the user's loop ran: state is a graph node
    assert model.state is not None and not model.state.is_leaf
    est = dk.estimate_memory(model, x, device="cpu")
    assert est.method.startswith("fake tensors"), est.method
    truth = measured_peak(model, x, loss_fn=cross_entropy_loss)
    assert abs(est.peak / truth - 1) <= 0.02, (est.peak, truth)


def test_copying_a_model_reads_no_config_field() -> None:
    # a transformers 5 config is a dataclass whose fields may raise when read (NeoMME's
    # per-layer ``sliding_window``): the copy looks only at tensors, and lists / dicts of them
    import dataclasses

    @dataclasses.dataclass
    class Config:
        width: int = 64

        def __getattribute__(self, name: str) -> object:
            if name == "width":
                raise AttributeError("'width' is per layer: read it from the layer")
            return object.__getattribute__(self, name)

    torch.manual_seed(0)
    model, x = StatefulNet(), torch.randn(16, 64)
    model.config = Config()  # type: ignore[assignment]
    model(x).sum().backward()
    est = dk.estimate_memory(model, x, device="cpu")
    assert est.method.startswith("fake tensors"), est.method


class TwoHeads(nn.Module):
    """An output with a branch the loss never reaches, as EncoderDecoderModel's encoder when the
    tiny decoder has no cross-attention: the branch's graph, and what it saves, lives as long as
    the loop keeps the output."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.head = nn.Linear(width, 10)
        self.unused = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(x), self.unused(x)


def test_truth_counts_what_the_kept_outputs_graph_saves() -> None:
    # the sweep read EncoderDecoderModel's own loss +10.0 % "over": the truth counted the kept
    # output's tensors but not the activations its unreached encoder graph still saved from
    # the step before (alive in the real loop, as the estimate says)
    torch.manual_seed(0)
    model, x = TwoHeads(), torch.randn(64, 256)

    def step(m: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = m(batch)
        out[0].sum().backward()
        return out                                  # kept by the loop until the next forward

    truth = measured_peak(model, x, step=step)
    est = dk.estimate_memory(model, x, device="cpu", step=step)
    assert abs(est.peak / truth - 1) <= 0.02, (est.peak, truth)
