"""Memory estimate on Hugging Face models: error and time against MemTracker and accelerate.

The models are the test zoo of transformers models (tests/memory/hf_zoo.py: tiny configs,
random weights: decoder LMs, an encoder MLM, T5 / Bart / Whisper, ViT, ResNet, ConvNeXt,
Mixtral with its default grouped experts, Wav2Vec2 CTC with its default LayerDrop) plus two
models of the issue's speed complaint (an 8.9M-parameter GRU language model and a ResNet-18),
each with two loops: the default one (``out = model(x)``, cross-entropy, nothing told to the
estimate) and the model's own loss (``model(**batch, labels=...).loss.backward()``, given as
``step=``). The truth is the live storage bytes after every op of the second real Adam step on
CPU (tests/memory/memory_truth.py). Against it:

* devicekit's ``estimate_memory`` (fake tensors; real CPU steps where fake tensors cannot run);
* torch's ``MemTracker`` (torch.distributed._tools.mem_tracker: runs two real steps);
* accelerate's ``estimate-memory`` for fp32 training: its own ``calculate_maximum_sizes`` and
  ``estimate_training_usage`` (the largest of its figures: weights x 4), called on the model
  built here, as the command does on an empty model from the Hub.

Seconds: the best of interleaved rounds (benchmarks/timing.py) after one untimed call, so
torch's first-call warm-up is not counted for either.

Run: python benchmarks/bench_estimate_hf.py [WORD...]  (a few minutes on 2 loaded cores; WORDs
pick the models whose names contain one)
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # the zoos of tests/memory
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from tests.memory.hf_zoo import HF_ZOO, HFCase, hf_step  # noqa: E402
from tests.memory.memory_truth import measured_peak  # noqa: E402
from timing import interleaved  # noqa: E402
from torch import nn  # noqa: E402

import devicekit as dk  # noqa: E402
from devicekit.memory.losses import cross_entropy_loss  # noqa: E402
from devicekit.memory.step import LoopOutput, make_optimizer, training_step  # noqa: E402


class _Loss(dict):
    """``out.loss`` for the dict the plain models return."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as exc:
            raise AttributeError(name) from exc


class GRULM(nn.Module):
    """The issue's slow case: embedding, a 2-layer GRU, a head over 8000 tokens (8.9M params)."""

    def __init__(self, vocab: int = 8000, dim: int = 256, hidden: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, hidden, 2, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.head(self.rnn(self.embed(input_ids))[0])
        if labels is None:
            return logits
        return _Loss(loss=nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()),
                     logits=logits)


class ResNet18(nn.Module):
    """ResNet-18's layout (basic blocks 2-2-2-2, 64-512 channels), 1000 classes."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                   nn.MaxPool2d(3, 2, 1)]
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [_Block(cin, cout, stride), _Block(cout, cout, 1)]
            cin = cout
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000)]
        self.net = nn.Sequential(*layers)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.net(pixel_values)
        if labels is None:
            return logits
        return _Loss(loss=nn.functional.cross_entropy(logits, labels), logits=logits)


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
        return torch.relu(y + self.down(x))


def _gru_lm() -> nn.Module:
    torch.manual_seed(0)
    return GRULM().train()


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    return ResNet18().train()


CASES: dict[str, HFCase] = {
    **HF_ZOO,
    "gru-lm 8.9M, seq 128": HFCase(_gru_lm, lambda n: {"input_ids": torch.randint(0, 8000, (n, 128))},
                                   lambda b: b["input_ids"], batch=16),
    "resnet-18, 128 px": HFCase(_resnet, lambda n: {"pixel_values": torch.randn(n, 3, 128, 128)},
                                lambda b: torch.zeros(b["pixel_values"].shape[0], dtype=torch.long), batch=8),
}


def accelerate_estimate(model: nn.Module) -> tuple[int, str]:
    """accelerate estimate-memory's fp32 training figure for ``model``, and where it came from."""
    try:
        from accelerate.commands.estimate import estimate_training_usage
        from accelerate.utils import calculate_maximum_sizes
    except ImportError:   # its documented formula: weights x 4 (weights, grads, Adam's two states)
        return 4 * sum(p.numel() * p.element_size() for p in model.parameters()), "formula"
    total, _largest = calculate_maximum_sizes(model)
    return int(max(estimate_training_usage(total, "float32").values())), "accelerate"


def memtracker_peak(model: nn.Module, sample: Any, *, step: Callable[[nn.Module, Any], Any] | None) -> int:
    """Peak bytes of two real Adam steps on CPU by torch's MemTracker; the loop keeps the output
    until the next forward returns (what ``step`` returns: until the next step returns, as
    ``out = step(model, x)``), as the truth's loop does."""
    from torch.distributed._tools.mem_tracker import MemTracker

    opt = make_optimizer("adam", model.parameters())
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker, LoopOutput(model, until_forward=step is None) as last:
        for _ in range(2):
            if step is None:
                last.keep(training_step(model, sample, opt, loss_fn=cross_entropy_loss, keep_output=True))
            else:
                opt.zero_grad(set_to_none=True)
                last.keep(step(model, sample))
                opt.step()
            tracker.reset_mod_stats()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def main() -> None:
    warnings.simplefilter("ignore")
    import transformers

    load = os.getloadavg()
    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{os.cpu_count()} cores, load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; Python "
          f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{'model':<22}{'loop':<9}{'batch':>6}{'truth MiB':>10}{'dk':>8}{'memtr':>8}{'accel':>8}"
          f"{'dk s':>7}{'memtr s':>8}  sized by")
    source = ""
    refusals: dict[str, str] = {}
    chosen = [name for name in CASES if not sys.argv[1:] or any(word in name for word in sys.argv[1:])]
    for name in chosen:
        case = CASES[name]
        model, batch = case.build(), case.sample(case.batch)
        accel, source = accelerate_estimate(model)
        for loop, step in (("default", None), ("own loss", hf_step(case))):
            if step is None:
                truth = measured_peak(model, batch, loss_fn=cross_entropy_loss)
            else:
                truth = measured_peak(model, batch, step=step)
            est = dk.estimate_memory(model, batch, step=step, device="cpu")
            methods: dict[str, Callable[[], object]] = {
                "dk": lambda m=model, b=batch, s=step: dk.estimate_memory(m, b, step=s, device="cpu")}
            try:
                memtr = f"{memtracker_peak(model, batch, step=step) / truth - 1:>+8.1%}"
                methods["memtr"] = lambda m=model, b=batch, s=step: memtracker_peak(m, b, step=s)
            except Exception as exc:   # MemTracker hooks every parameter: a frozen one fails it
                memtr, refusals[name] = f"{'fails':>8}", f"{type(exc).__name__}: {exc}"
            times = interleaved(methods, rounds=2, warmup=0)
            memtr_s = f"{min(times['memtr']):>8.2f}" if "memtr" in times else f"{'-':>8}"
            sized_by = "fake tensors" if est.method.startswith("fake") else est.method.split(" (")[0]
            print(f"{name:<22}{loop:<9}{case.batch:>6}{truth / 2**20:>10.2f}{est.peak / truth - 1:>+8.1%}"
                  f"{memtr}{accel / truth - 1:>+8.1%}{min(times['dk']):>7.2f}{memtr_s}  {sized_by}",
                  flush=True)
    for name, why in refusals.items():
        print(f"# MemTracker fails on {name}: {why}")
    load = os.getloadavg()
    print(f"# accelerate: {source} ({'its own functions' if source == 'accelerate' else 'not installed'}); "
          f"load at the end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    main()
