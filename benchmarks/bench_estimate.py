"""Memory estimate: error and time, devicekit vs torch's MemTracker vs accelerate's formula.

The truth for each zoo model (tests/memory/zoo.py, each with its own loss, the common loop:
output kept until the next step) is the live storage bytes after every op of the second
real Adam step on CPU (tests/memory/memory_truth.py). Against it: devicekit's
``estimate_memory`` (fake tensors; real CPU steps extrapolated for the data-dependent MoE),
torch's ``MemTracker`` (runs the step; the anchor that gets an LSTM right), and accelerate's
``estimate-memory`` formula, re-implemented from its documentation because accelerate is not
installed here (weights x 4 for Adam training, no activations). Time: MemTracker's seconds
over devicekit's, each the best of interleaved rounds (benchmarks/timing.py), on the zoo and
on two models over 500 MiB.

Run: python benchmarks/bench_estimate.py  (a few minutes on 2 loaded cores)
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # the zoo of tests/memory
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from tests.memory.estimate_models import measured_peak_cpu  # noqa: E402
from tests.memory.memory_truth import measured_peak  # noqa: E402
from tests.memory.zoo import ZOO, Case, lm_loss, mse_first  # noqa: E402
from timing import interleaved  # noqa: E402
from torch import nn  # noqa: E402

import devicekit as dk  # noqa: E402


def accelerate_formula(model: nn.Module) -> int:
    """accelerate estimate-memory, training with Adam: 4x the weights, nothing for activations."""
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def big_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)


def big_lstm() -> nn.Module:
    return nn.LSTM(512, 1024, 2, batch_first=True)


CASES: list[tuple[str, Case, int]] = [(name, case, 8) for name, case in ZOO.items()]
CASES += [("encoder 512x4, seq 256 (big)", Case(big_encoder, lambda n: torch.randn(n, 256, 512), mse_first), 16),
          ("lstm 512->1024 x2, seq 100 (big)", Case(big_lstm, lambda n: torch.randn(n, 100, 512), mse_first), 32)]


def main() -> None:
    print(f"# {platform.machine()} {platform.python_version()} torch {torch.__version__}; "
          "accelerate: its documented formula (not installed); truth: live storage bytes")
    print(f"{'model':<34}{'batch':>6}{'truth MiB':>10}{'dk':>8}{'memtr':>8}{'accel':>8}"
          f"{'dk s':>8}{'memtr s':>9}{'speed':>8}")
    for name, case, batch in CASES:
        torch.manual_seed(0)
        model, sample = case.build(), case.sample(batch)
        truth = measured_peak(model, sample, loss_fn=case.loss, precision=case.precision)
        est = dk.estimate_memory(model, sample, loss_fn=case.loss, precision=case.precision, device="cpu")
        memtr = measured_peak_cpu(model, sample, precision=case.precision, loss_fn=case.loss)
        rounds = 2 if "big" in name else 3
        times = interleaved({
            "dk": lambda m=model, s=sample, c=case: dk.estimate_memory(m, s, loss_fn=c.loss, precision=c.precision,
                                                                       device="cpu"),
            "memtr": lambda m=model, s=sample, c=case: measured_peak_cpu(m, s, precision=c.precision, loss_fn=c.loss),
        }, rounds=rounds, warmup=0)
        dk_s, mt_s = min(times["dk"]), min(times["memtr"])
        print(f"{name:<34}{batch:>6}{truth / 2**20:>10.1f}{est.peak / truth - 1:>+8.1%}{memtr / truth - 1:>+8.1%}"
              f"{accelerate_formula(model) / truth - 1:>+8.1%}{dk_s:>8.2f}{mt_s:>9.2f}{mt_s / dk_s:>7.1f}x",
              flush=True)
    torch.manual_seed(0)
    gpt, tokens = ZOO["gpt-tied"].build(), ZOO["gpt-tied"].sample(8)
    truth = measured_peak(gpt, tokens, loss_fn=lm_loss)
    default = dk.estimate_memory(gpt, tokens, device="cpu").peak
    old = dk.estimate_memory(gpt, tokens, loss_fn="sum", device="cpu").peak
    print(f"default (nothing given) on gpt-tied: {default / truth - 1:+.1%}; "
          f"the old default (sum loss, output freed): {old / truth - 1:+.1%}")


if __name__ == "__main__":
    main()
