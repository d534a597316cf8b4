"""Memory estimate: error and time, devicekit vs accelerate's formula vs torch's MemTracker.

For each model and batch the truth is the peak of two real training steps (Adam) measured by
torch's ``MemTracker`` on CPU (``torch.cuda.max_memory_allocated`` on a GPU). accelerate is not
installed here, so its ``estimate-memory`` is re-implemented from its documentation: weights x 4
for Adam training (weights, gradients, two moments), no activations. devicekit's
``estimate_memory`` runs the step on fake tensors. Printed: estimate / truth for each, how much
closer devicekit is (|accelerate error| / |devicekit error|), and MemTracker's time over
devicekit's (MemTracker runs the real step).

Run: python benchmarks/bench_estimate.py  (about a minute on 2 cores)
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # the models of tests/memory

import torch  # noqa: E402
from tests.memory.estimate_models import MODELS, measured_peak_cpu  # noqa: E402
from torch import nn  # noqa: E402

import devicekit as dk  # noqa: E402


def accelerate_formula(model: nn.Module) -> int:
    """accelerate estimate-memory, training with Adam: 4x the weights, nothing for activations."""
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def bigger_transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)


CASES = [(name, build, make, batch) for name, (build, make) in MODELS.items() for batch in (8, 32)]
CASES.append(("transformer-512x4 seq 256", bigger_transformer,
              lambda n, d="cpu": torch.randn(n, 256, 512, device=d), 16))


def main() -> None:
    print(f"# {platform.machine()} {platform.python_version()} torch {torch.__version__}; "
          "accelerate: its documented formula (not installed)")
    print(f"{'model':<28}{'batch':>6}{'truth MiB':>11}{'dk/truth':>10}{'acc/truth':>11}"
          f"{'closer':>8}{'dk s':>8}{'memtr s':>9}{'speed':>7}")
    for name, build, make, batch in CASES:
        torch.manual_seed(0)
        model, sample = build(), make(batch)
        start = time.perf_counter()
        est = dk.estimate_memory(model, sample, device="cpu")
        dk_s = time.perf_counter() - start
        start = time.perf_counter()
        truth = measured_peak_cpu(model, sample)
        mt_s = time.perf_counter() - start
        acc = accelerate_formula(model)
        dk_err, acc_err = abs(est.peak / truth - 1), abs(acc / truth - 1)
        closer = acc_err / dk_err if dk_err else float("inf")
        print(f"{name:<28}{batch:>6}{truth / 2**20:>11.1f}{est.peak / truth:>10.3f}{acc / truth:>11.3f}"
              f"{closer:>8.0f}x{dk_s:>7.2f}{mt_s:>9.2f}{mt_s / dk_s:>6.1f}x")


if __name__ == "__main__":
    main()
