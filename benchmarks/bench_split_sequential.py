"""dk.split of an nn.Sequential (one split path, issue 18) vs the same Sequential placed by hand.

Run: ``.venv/bin/python benchmarks/bench_split_sequential.py`` (about a minute on 2 cores).

Since issue 18 an ``nn.Sequential`` is split by the same unit planner as any module. Its split
(a ``SplitModel``) moves each layer's input itself when every layer is placed whole, instead of
the module hooks and parent-code mode that any other module needs. What is measured: one
training step (forward + backward) of 12 x (Linear(width) + ReLU), batch 64, for

* the anchor: the Sequential placed by hand on the same device map (two slices, ``x.to(d)``
  between them: the seeds' way, and the old ``SplitModel``'s);
* ``dk.split(model, devices, balance=[12, 12])`` (the route the split takes);
* the same plan placed with hooks (``dk.ModuleSplit``, as a custom module would be), to show
  what the route saves;

at width 64 (tiny layers: per-layer overhead shows) and 1024 (layers that do real work). On this
CPU-only machine the devices are ``["cpu", "cpu"]`` (moves are no-ops: what remains is
devicekit's own cost); ``--gpu`` uses ``["cuda:0", "cuda:1"]``. Methods take turns in
interleaved rounds; best and median ratios are printed (the machine is shared).
"""

from __future__ import annotations

import copy
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from timing import interleaved  # noqa: E402  (benchmarks/timing.py)

import devicekit as dk  # noqa: E402

ROUNDS = 15
DEPTH = 12


def sequential(width: int) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(DEPTH) for m in (nn.Linear(width, width), nn.ReLU())])


class ByHand(nn.Module):
    """The two halves on their devices, the activation moved between them."""

    def __init__(self, model: nn.Sequential, devices: list[torch.device]) -> None:
        super().__init__()
        half = len(model) // 2
        self.first, self.second = model[:half].to(devices[0]), model[half:].to(devices[1])
        self.devices = devices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x.to(self.devices[0])).to(self.devices[1]))


def step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.pow(2).mean().backward()
        if out.device.type == "cuda":
            torch.cuda.synchronize()
    return run


def main(argv: list[str]) -> None:
    gpu = "--gpu" in argv
    torch.set_num_threads(1)
    devices = [torch.device("cuda:0"), torch.device("cuda:1")] if gpu else [torch.device("cpu")] * 2
    print(f"devices {[str(d) for d in devices]}, torch {torch.__version__}, {ROUNDS} interleaved rounds, "
          "1 torch thread\n")
    for width in (64, 1024):
        torch.manual_seed(0)
        base = sequential(width)
        x = torch.randn(64, width)
        hand = ByHand(copy.deepcopy(base), devices)
        split = dk.split(copy.deepcopy(base), devices, balance=[DEPTH, DEPTH])
        hooked = dk.ModuleSplit(copy.deepcopy(base), split.plan)  # the same plan, placed with hooks
        assert isinstance(split, dk.SplitModel) and split._route is not None
        want = hand(x)
        for model in (split, hooked):
            torch.testing.assert_close(model(x), want)
        times = interleaved({"by hand (anchor)": step(hand, x), "dk.split (routes inputs)": step(split, x),
                             "same plan with hooks": step(hooked, x)}, ROUNDS, warmup=2)
        anchor = "by hand (anchor)"
        best0, med0 = min(times[anchor]), statistics.median(times[anchor])
        print(f"{DEPTH} x (Linear({width}) + ReLU), batch 64: training step")
        print(f"  {'method':<30}{'best ms':>9}{'time / anchor':>15}{'(median)':>10}")
        for name, values in times.items():
            best, med = min(values), statistics.median(values)
            print(f"  {name:<30}{best * 1e3:>9.2f}{best / best0:>15.3f}{med / med0:>10.3f}")
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
