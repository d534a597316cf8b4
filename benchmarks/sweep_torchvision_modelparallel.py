"""torchvision's model registry through dk.split and dk.Pipeline: equal to the unsplit model, or refused by name.

Run: ``PYTHONPATH=src python benchmarks/sweep_torchvision_modelparallel.py [--max-params 30e6] [--devices 2]``
(needs torchvision; about 10 minutes on 2 loaded cores for the models up to 30M parameters).

Every classification model ``torchvision.models.list_models(module=torchvision.models)`` names
(random weights, seeded), up to ``--max-params`` parameters, on a batch of 4 small images, over
``--devices`` CPU "devices":

* ``split``: ``dk.split(model, devices, sample=x)``: outputs and every gradient against the
  unsplit model on the same batch (train mode, dropout off);
* ``Pipeline``: ``dk.Pipeline(model, devices, chunks=2, sample=x)``: in eval mode, outputs and
  every gradient against the unsplit model on the whole batch; in train mode (dropout off) the
  same against the unsplit model run on the same two micro-batches (BatchNorm normalises per
  micro-batch, as documented).

Each run is tallied as ``equal`` (outputs and gradients within 1e-4 relative of the largest
value), ``refused`` (a one-line DeviceKitError, with its reason), ``DIFFERENT`` (silently
different: the case that must not exist) or ``CRASH`` (any other exception).

On a machine whose only torchvision wheel is the CUDA build (its C++ operators cannot load
beside a CPU torch, and ``import torchvision`` fails registering them), the script imports it
without those operators: the classification models are pure Python and need none.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import types
import warnings
from collections import Counter
from typing import Any

import torch
from torch import nn

import devicekit as dk

TOLERANCE = 1e-4
#: models with a fixed input size, or a minimum above the sweep's 64 pixels
SIZES = {"inception_v3": 96, "maxvit_t": 224, "swin_": 64}


def import_torchvision() -> Any:
    """torchvision, also from a CUDA-only wheel beside a CPU torch (without its C++ operators)."""
    try:
        import torchvision
        return torchvision
    except (ImportError, RuntimeError) as exc:
        print(f"note: import torchvision failed ({type(exc).__name__}: {exc}); importing it without its C++ "
              "operators (the classification models do not use them)")
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        import torchvision
        return torchvision


def size_of(name: str) -> int:
    if name.startswith("vit_"):  # a multiple of the patch (vit_h_14: 56)
        return int(name.rsplit("_", 1)[-1]) * 4
    return next((s for prefix, s in SIZES.items() if name.startswith(prefix)), 64)


def options(name: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"weights": None, "num_classes": 10}
    if name.startswith("vit_"):
        kwargs["image_size"] = size_of(name)
    if name in ("inception_v3", "googlenet"):
        kwargs.update(aux_logits=False, init_weights=False)
    return kwargs


def parameters(tv: Any, name: str) -> int:
    """The model's parameter count, built on the meta device (no memory, no initialisation)."""
    try:
        with torch.device("meta"):
            return sum(p.numel() for p in tv.models.get_model(name, **options(name)).parameters())
    except Exception:  # noqa: BLE001 - some initialisations copy values (RegNet): count a real one
        return sum(p.numel() for p in tv.models.get_model(name, **options(name)).parameters())


def build(tv: Any, name: str) -> tuple[nn.Module, torch.Tensor]:
    size = size_of(name)
    torch.manual_seed(0)
    model = tv.models.get_model(name, **options(name))
    for m in model.modules():  # dropout off: the comparisons are exact, not in distribution
        if isinstance(m, nn.modules.dropout._DropoutNd) or type(m).__name__ == "StochasticDepth":
            m.p = 0.0
    return model, torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(1))


def tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in tensors(o)]
    return []


def loss_of(out: Any) -> torch.Tensor:
    return sum((t.float() * torch.linspace(-1, 1, t.numel()).reshape(t.shape)).sum() for t in tensors(out))


def differs(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest difference relative to the largest value (0.0: equal; inf: shapes differ)."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        scale = max(float(y.abs().max()), 1e-6) if y.numel() else 1.0
        worst = max(worst, float((x.detach().float() - y.detach().float()).abs().max()) / scale if x.numel() else 0)
    return worst


def compare(model: nn.Module, x: torch.Tensor, make: Any, *, train: bool, chunks: int) -> tuple[str, str]:
    ref = copy.deepcopy(model).train(train)
    if chunks > 1 and train:  # the same micro-batches, unsplit
        want = torch.cat([ref(part) for part in x.chunk(chunks)])
    else:
        want = ref(x)
    loss_of(want).backward()
    mine = copy.deepcopy(model).train(train)
    try:
        wrapped = make(mine)
        got = wrapped(x)
        loss_of(got).backward()
    except dk.DeviceKitError as exc:
        return "refused", str(exc).splitlines()[0][:160]
    except Exception as exc:  # noqa: BLE001 - a raw error is what the sweep reports
        return "CRASH", f"{type(exc).__name__}: {str(exc)[:160]}"
    finally:
        close = getattr(locals().get("wrapped"), "close", None)
        if close is not None:
            close()
    grads = [(p.grad, q.grad) for p, q in zip(mine.parameters(), ref.parameters(), strict=True)
             if q.grad is not None or p.grad is not None]
    if any(p is None or q is None for p, q in grads):
        return "DIFFERENT", "a parameter has a gradient on one side only"
    worst = max(differs(tensors(got), tensors(want)), differs([p for p, _ in grads], [q for _, q in grads]))
    return ("equal", f"{worst:.1e}") if worst <= TOLERANCE else ("DIFFERENT", f"max relative difference {worst:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-params", type=float, default=30e6)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="model names (default: the whole registry)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    tv = import_torchvision()
    devices = ["cpu"] * args.devices
    names = args.only or tv.models.list_models(module=tv.models)
    print(f"machine: torch {torch.__version__}, torchvision {tv.__version__}, devices {devices}")
    tally: Counter[tuple[str, str]] = Counter()
    skipped = []
    for name in names:
        params = parameters(tv, name)
        if params > args.max_params:
            skipped.append(name)
            continue
        model, x = build(tv, name)
        start = time.perf_counter()
        runs = {
            "split": compare(model, x, lambda m, x=x: dk.split(m, devices, sample=x), train=True, chunks=1),
            "Pipeline eval": compare(model, x, lambda m, x=x: dk.Pipeline(m, devices, chunks=2, sample=x),
                                     train=False, chunks=1),
            "Pipeline train": compare(model, x, lambda m, x=x: dk.Pipeline(m, devices, chunks=2, sample=x),
                                      train=True, chunks=2),
        }
        for what, (verdict, _) in runs.items():
            tally[what, verdict] += 1
        line = "; ".join(f"{what} {verdict} ({detail})" for what, (verdict, detail) in runs.items())
        print(f"{name:22s} {params / 1e6:6.1f}M {time.perf_counter() - start:5.1f}s  {line}", flush=True)
    print(f"\nskipped (over {args.max_params / 1e6:.0f}M parameters): {len(skipped)}: {', '.join(skipped)}")
    print("\n| run | equal | refused | DIFFERENT | CRASH |\n|---|---|---|---|---|")
    for what in ("split", "Pipeline eval", "Pipeline train"):
        print(f"| {what} | " + " | ".join(str(tally[what, v]) for v in ("equal", "refused", "DIFFERENT", "CRASH")) + " |")


if __name__ == "__main__":
    main()
