"""The leak finder's cost per step on leaks only the memory shows, and on a clean loop (issue 36).

A small MLP (256-512-512-10, batch 64, Adam) trains on the CPU for ``STEPS`` steps. Each
workload runs as a plain loop and under ``dk.find_leaks(step, steps=STEPS)`` (the clean one also
under a ``dk.LeakDetector`` in a hand-written loop); the table shows the median CPU milliseconds
per step (process time, one torch thread) over interleaved rounds (``timing.interleaved``), the
ratio to the plain loop of the same workload in the same run, and what the finder named. The
leaking workloads are the kinds issue 36 lists: an exception chain, a running loss in a closure
cell, a linked list through tensor attributes, suspended generators, ``.numpy()`` views,
``autograd.grad(create_graph=True)`` results, a ``retain_graph`` chain and a hook per step.

Run: python benchmarks/bench_leaks_memory.py [--rounds N] [--steps N] [--only WORKLOAD ...]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's devicekit
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from timing import interleaved  # noqa: E402
from torch import nn  # noqa: E402

import devicekit as dk  # noqa: E402

Step = Callable[[], None]


def setup() -> tuple[nn.Sequential, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), torch.randn(64, 256), torch.randint(0, 10, (64,))


def trained(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = nn.functional.cross_entropy(out, y)
    loss.backward()
    opt.step()
    return out, loss


class State:
    last_error: BaseException | None = None


LAST: list[Any] = [None]


def clean() -> Step:
    model, opt, x, y = setup()
    log: list[float] = []
    return lambda: log.append(trained(model, opt, x, y)[1].item())


def exception_chain() -> Step:
    model, opt, x, y = setup()
    state = State()

    def step() -> None:
        out, loss = trained(model, opt, x, y)
        try:
            raise RuntimeError("bad batch")
        except RuntimeError as e:
            e.__cause__ = state.last_error
            state.last_error = e
    return step


def closure_running() -> Step:
    model, opt, x, y = setup()
    running: Any = 0.0

    def step() -> None:
        nonlocal running
        running = 0.98 * running + 0.02 * trained(model, opt, x, y)[1]
    return step


def tensor_attribute_chain() -> Step:
    model, opt, x, y = setup()
    head: list[Any] = [None]

    def step() -> None:
        out = trained(model, opt, x, y)[0]
        out.prev = head[0]
        head[0] = out
    return step


def suspended_generators() -> Step:
    model, opt, x, y = setup()
    pending: list[Iterator[Any]] = []

    def predictions() -> Iterator[Any]:
        logits = model(x)
        yield logits.argmax(1)
        yield logits.softmax(1)

    def step() -> None:
        trained(model, opt, x, y)
        gen = predictions()
        next(gen)
        pending.append(gen)
    return step


def numpy_views() -> Step:
    model, opt, x, y = setup()
    arrays: list[Any] = []
    return lambda: arrays.append(trained(model, opt, x, y)[0].detach().numpy())


def create_graph_results() -> Step:
    model, opt, x, y = setup()
    kept: list[Any] = []

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        kept.append(torch.autograd.grad(loss, list(model.parameters()), create_graph=True))
    return step


def retain_graph_chain() -> Step:
    model, opt, x, y = setup()
    delta: Any = torch.zeros(64, 256, requires_grad=True)

    def step() -> None:
        nonlocal delta
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x + delta), y)
        loss.backward(retain_graph=True)
        opt.step()
        delta = (delta + 0.01 * x).tanh()
    return step


def hook_every_step() -> Step:
    model, opt, x, y = setup()

    def step() -> None:
        feats: list[Any] = []
        model[1].register_forward_hook(lambda m, i, o: feats.append(o))
        trained(model, opt, x, y)
    return step


WORKLOADS = {fn.__name__: fn for fn in (clean, exception_chain, closure_running, tensor_attribute_chain,
                                        suspended_generators, numpy_views, create_graph_results,
                                        retain_graph_chain, hook_every_step)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", nargs="+", choices=list(WORKLOADS), help="these workloads only")
    options = parser.parse_args()
    steps = options.steps
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, torch {torch.__version__}, Python {platform.python_version()}; "
          f"{steps} steps, {options.rounds} rounds")
    per_step: dict[str, list[float]] = {}
    named: dict[str, str] = {}

    def plain(name: str) -> Callable[[], None]:
        def run() -> None:
            step = WORKLOADS[name]()
            began = time.process_time()
            for _ in range(steps):
                step()
            per_step.setdefault(f"{name}: plain", []).append((time.process_time() - began) / steps)
        return run

    def found(name: str) -> Callable[[], None]:
        def run() -> None:
            step = WORKLOADS[name]()
            began = time.process_time()
            report = dk.find_leaks(step, steps=steps)
            per_step.setdefault(f"{name}: find_leaks", []).append((time.process_time() - began) / steps)
            named[name] = ", ".join(f"{leak.holder} ({leak.kind})" for leak in report.leaks) or "no leak"
        return run

    def by_hand() -> None:
        step = WORKLOADS["clean"]()
        began = time.process_time()
        with dk.LeakDetector() as ld:
            for _ in range(steps):
                step()
                ld.step()
        per_step.setdefault("clean: LeakDetector", []).append((time.process_time() - began) / steps)
        assert ld.report().ok, ld.report()

    names = options.only or list(WORKLOADS)
    methods: dict[str, Callable[[], None]] = {}
    for name in names:
        methods[f"{name}: plain"] = plain(name)
        methods[f"{name}: find_leaks"] = found(name)
    if "clean" in names:
        methods["clean: LeakDetector"] = by_hand
    interleaved(methods, rounds=options.rounds, warmup=1)
    print(f"load average {' '.join(f'{n:.2f}' for n in os.getloadavg())} after the run")
    print("| workload | plain ms/step | find_leaks ms/step | ratio | named |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name in names:
        bare = statistics.median(per_step[f"{name}: plain"]) * 1e3
        checked = statistics.median(per_step[f"{name}: find_leaks"]) * 1e3
        print(f"| {name} | {bare:.2f} | {checked:.2f} | {checked / bare:.2f}x | {named[name]} |")
    if "clean" not in names:
        return
    hand = statistics.median(per_step["clean: LeakDetector"]) * 1e3
    bare = statistics.median(per_step["clean: plain"]) * 1e3
    print(f"| clean, `with LeakDetector()` in a hand loop | {bare:.2f} | {hand:.2f} | {hand / bare:.2f}x | |")


if __name__ == "__main__":
    main()
