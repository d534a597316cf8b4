"""Weighted vs equal batch split on a simulated mixed machine (H100 + A100 + T4).

Time-per-step model: each GPU's time is its share of the batch divided by its speed (the
capability score devicekit uses for ``weights="auto"``); a data-parallel step lasts as long as
the slowest GPU. Prints the step-time ratio equal / weighted (higher: weighting helps more).
On a machine with two or more real GPUs it also measures BalancedDataParallel both ways.

Usage::

    PYTHONPATH=src python benchmarks/bench_weighted_split.py
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from devicekit.hardware.capability import capabilities
from devicekit.hardware.simulated import load_simulation
from devicekit.parallel.weighted_split import split_sizes

MACHINE = {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_total": "80GiB"},
                    {"name": "NVIDIA A100-SXM4-80GB", "memory_total": "80GiB"},
                    {"name": "Tesla T4", "memory_total": "16GiB"}]}


def modelled(batch: int = 768) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(MACHINE, fh)
    try:
        gpus = load_simulation(fh.name)
    finally:
        os.unlink(fh.name)
    speeds = [c.score for c in capabilities(gpus)]
    equal = split_sizes(batch, [1.0] * len(gpus))
    weighted = split_sizes(batch, speeds)
    t_equal = max(n / s for n, s in zip(equal, speeds, strict=True))
    t_weighted = max(n / s for n, s in zip(weighted, speeds, strict=True))
    print("simulated H100 + A100 + T4, batch", batch)
    print("  speeds (TFLOP/s, datasheet):", [round(s) for s in speeds])
    print("  equal split   ", equal, f"step time {t_equal * 1e3:.3f} (model units)")
    print("  weighted split", weighted, f"step time {t_weighted * 1e3:.3f} (model units)")
    print(f"  ratio equal/weighted step time: {t_equal / t_weighted:.2f}x")


def measured() -> None:
    import torch
    from torch import nn

    import devicekit as dk

    if torch.cuda.device_count() < 2:
        print("measured: skipped (needs two or more GPUs)")
        return
    net = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)]).cuda()
    x = torch.randn(1024, 4096, device="cuda")
    y = torch.randn(1024, 4096, device="cuda")
    for weights in (None, "auto"):
        model = dk.BalancedDataParallel(net, nn.MSELoss(), weights=weights)
        for _ in range(3):
            model(x, y).backward()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            model(x, y).backward()
        torch.cuda.synchronize()
        print(f"measured weights={weights!r}: {(time.perf_counter() - t0) / 10 * 1e3:.1f} ms/step")


if __name__ == "__main__":
    modelled()
    measured()
