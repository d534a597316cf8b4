"""dk.split of a non-Sequential model vs the same model placed by hand, and vs accelerate's dispatch_model.

Run: ``/work/main/.venv/bin/python benchmarks/bench_split_any.py`` (about a minute on 2 cores).

What is measured: the time of one training step (forward + backward) of

1. the seeds' ``Net`` (two sub-networks, here 4 x Linear(1024) + ReLU each, batch 256), placed
   by hand as the seeds do (``sub_network1.to(d0)``, ``x = x.to(d1)`` in ``forward``) against
   ``dk.split(Net(), devices)`` on the same device map (sub_network1 on d0, sub_network2 on d1);
2. a GPT-style model (tied embeddings, a positional ``nn.Parameter`` of the model itself, 4
   blocks called with a keyword mask), unsplit against ``dk.split`` over 2 devices, and the same
   split with its ``MixedDeviceMode`` bypassed (the model called directly: hooks only), which
   isolates what the mode costs for the parent's own ops;
3. the per-call overhead on a tiny model (microseconds per forward), where nothing else hides it.

On this CPU-only machine ``devices = ["cpu", "cpu"]`` (the moves are no-ops: what remains is
the hooks' and the mode's own cost, the part devicekit adds); on a machine with 2 GPUs pass
``--gpu`` for ``["cuda:0", "cuda:1"]``. Methods take turns in interleaved rounds; best and
median ratios are printed (the machine is shared). accelerate's ``dispatch_model`` (hooks that
move inputs to each module's device; made for inference) runs on the same device map where
accelerate is installed; otherwise that row says why it is skipped.
"""

from __future__ import annotations

import copy
import importlib.util
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # the models of tests/modelparallel

from tests.modelparallel.any_models import GPT  # noqa: E402
from timing import interleaved as _interleaved  # noqa: E402  (benchmarks/timing.py)

import devicekit as dk  # noqa: E402

ROUNDS = 15


def interleaved(methods: dict[str, Callable[[], object]], rounds: int = ROUNDS) -> dict[str, list[float]]:
    return _interleaved(methods, rounds, warmup=2)


class MLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Net(nn.Module):
    """The seeds' model: two sub-networks, no device code."""

    def __init__(self, width: int = 1024, depth: int = 4) -> None:
        super().__init__()
        self.sub_network1 = MLP(width, depth)
        self.sub_network2 = MLP(width, depth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sub_network2(self.sub_network1(x))


class HandNet(Net):
    """The seeds' hand placement: .to(d) in __init__, x = x.to(d) in forward."""

    def __init__(self, d0: torch.device, d1: torch.device, width: int = 1024, depth: int = 4) -> None:
        super().__init__(width, depth)
        self.d0, self.d1 = d0, d1
        self.sub_network1.to(d0)
        self.sub_network2.to(d1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.sub_network1(x.to(self.d0))
        return self.sub_network2(x.to(self.d1))


def step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.float().pow(2).mean().backward()
        if out.device.type == "cuda":
            torch.cuda.synchronize()
    return run


def report(title: str, times: dict[str, list[float]], anchor: str) -> None:
    print(title)
    best0, med0 = min(times[anchor]), statistics.median(times[anchor])
    print(f"  {'method':<44}{'best ms':>9}{'time / anchor':>15}{'(median)':>10}")
    for name, values in times.items():
        best, med = min(values), statistics.median(values)
        print(f"  {name:<44}{best * 1e3:>9.2f}{best / best0:>15.3f}{med / med0:>10.3f}")


def full_map(split: nn.Module) -> dict[str, str]:
    """The plan's device map plus the model's own tensors (accelerate wants every parameter)."""
    device_map = dict(split.plan.device_map)
    covered = tuple(f"{name}." for name in device_map)
    for name, tensor in (*split.module.named_parameters(), *split.module.named_buffers()):
        if name not in device_map and not name.startswith(covered):
            device_map[name] = str(tensor.device)
    return device_map


def accelerate_dispatch(model: nn.Module, device_map: dict[str, str]) -> nn.Module | str:
    if importlib.util.find_spec("accelerate") is None:
        return "skipped: accelerate is not installed here (pip install accelerate to add this row)"
    from accelerate import dispatch_model

    main = next(iter(device_map.values()))
    return dispatch_model(model, device_map={k: torch.device(v) for k, v in device_map.items()},
                          main_device=main)


def main(argv: list[str]) -> None:
    gpu = "--gpu" in argv
    torch.set_num_threads(1)
    devices = [torch.device("cuda:0"), torch.device("cuda:1")] if gpu else [torch.device("cpu")] * 2
    print(f"devices {[str(d) for d in devices]}, torch {torch.__version__}, {ROUNDS} interleaved rounds, "
          "1 torch thread\n")

    torch.manual_seed(0)
    base = Net()
    x = torch.randn(256, 1024)
    hand = HandNet(*devices)
    hand.load_state_dict(base.state_dict())
    split = dk.split(copy.deepcopy(base), devices, balance=[1, 1])
    assert split.plan.device_map == {"sub_network1": str(devices[0]), "sub_network2": str(devices[1])}
    methods: dict[str, Callable[[], object]] = {
        "by hand (seeds: .to in __init__ and forward)": step(hand, x),
        "dk.split(Net(), devices)": step(split, x),
    }
    dispatched = accelerate_dispatch(copy.deepcopy(base), split.plan.device_map)
    if isinstance(dispatched, nn.Module):
        methods["accelerate dispatch_model, same map"] = step(dispatched, x)
    report("1. seeds' Net, 2 x (4 x Linear(1024) + ReLU), batch 256: training step", interleaved(methods),
           "by hand (seeds: .to in __init__ and forward)")
    if isinstance(dispatched, str):
        print(f"  accelerate dispatch_model: {dispatched}")

    torch.manual_seed(0)
    gpt = GPT(vocab=1000, dim=256, depth=4, heads=4, context=64)
    idx = torch.randint(0, 1000, (16, 64))
    plain = copy.deepcopy(gpt).to(devices[0])
    gsplit = dk.split(copy.deepcopy(gpt), devices, sample=idx)
    hooks_only = gsplit.module  # called directly: units' hooks, no MixedDeviceMode
    methods = {"unsplit, one device": step(plain, idx), "dk.split over 2 devices": step(gsplit, idx),
               "dk.split, mode bypassed (hooks only)": step(hooks_only, idx)}
    gdispatched = accelerate_dispatch(copy.deepcopy(gpt), full_map(gsplit))
    if isinstance(gdispatched, nn.Module):
        methods["accelerate dispatch_model, same map"] = step(gdispatched, idx)
    print()
    report("2. GPT-style (tied head, own positional parameter, 4 blocks of 256), batch 16 x 64: training step",
           interleaved(methods), "unsplit, one device")
    print(f"  plan: {gsplit.plan.counts} units per part; {gsplit.plan.tied[0]}")

    tiny = Net(width=8, depth=1)
    tsplit = dk.split(copy.deepcopy(tiny), devices, balance=[1, 1])
    thand = HandNet(*devices, width=8, depth=1)
    thand.load_state_dict(tiny.state_dict())
    xs = torch.randn(4, 8)
    with torch.no_grad():
        times = interleaved({"hand": lambda: [thand(xs) for _ in range(200)],
                             "split": lambda: [tsplit(xs) for _ in range(200)]}, rounds=7)
    us = {k: min(v) / 200 * 1e6 for k, v in times.items()}
    print(f"\n3. per-call overhead, tiny Net (2 units, Linear(8)), forward only: by hand {us['hand']:.1f} us, "
          f"dk.split {us['split']:.1f} us: +{us['split'] - us['hand']:.1f} us per call "
          f"(+{(us['split'] - us['hand']) / 2:.1f} us per unit)")


if __name__ == "__main__":
    main(sys.argv[1:])
