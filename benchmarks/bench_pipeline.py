"""Pipeline vs naive split on CPU, and devicekit's balancer vs accelerate's device map.

Run: ``/work/main/.venv/bin/python benchmarks/bench_pipeline.py`` (about a minute on 2 cores).

Part 1: an 8-layer MLP split over two CPU "devices" (``["cpu", "cpu"]``). The naive split
(``dk.split``) runs the parts one after another; ``dk.Pipeline`` cuts each batch into ``chunks``
micro-batches and runs them in its persistent micro-batch threads (micro-batch i enters a stage once
micro-batch i - 1 left it). The previous scheme
(torchgpipe's: new threads on every call, the caller waiting at every clock tick) is measured in
the same rounds on the same parts. Best and median ratios are both printed (the machine is shared). torch's intra-op threads are limited to 1
(``torch.set_num_threads(1)``) so that each stage owns one core and the two can overlap: with
torch's default (all cores per op) the stages would fight for the same cores. The forward pass is
measured (what overlaps on CPU: torch's autograd engine runs CPU backward on the calling
thread, so a CPU backward is serial; on GPUs it has one thread per device). Idle fraction
measured = 1 - sum(stage busy time) / (stages x wall time), beside GPipe's prediction
(n-1)/(m+n-1) for equal stages.

Part 2: how evenly each method cuts an uneven model (embedding, 8 transformer layers, big
output head; built on the meta device) into 2 and 4 parts, scored by the cost devicekit
balances (training memory: weights + grads + adam state + saved activations): largest part /
mean part (1.00 is perfect). Compared: devicekit's ``balance="size"``, accelerate's
``infer_auto_device_map`` (with ``get_balanced_memory``, and with equal budgets), and an equal
layer count per part. torchgpipe (``balance_by_size``/``balance_by_time``) is not installed
here, so it is not in the table.

Part 3: the same for ``balance="time"`` on a small real model: per-layer forward+backward time,
devicekit's cut against an equal layer count.
"""

from __future__ import annotations

import logging
import os
import platform
import queue
import statistics
import threading
import time
import warnings

import torch
from timing import interleaved as _interleaved  # benchmarks/timing.py
from torch import nn

import devicekit as dk
from devicekit.modelparallel.balance import max_over_mean, part_costs
from devicekit.modelparallel.layer_plan import build_plan
from devicekit.modelparallel.layer_profile import (
    optimizer_factor,
    profile_layers,
    sequential_layers,
)
from devicekit.modelparallel.schedule import bubble_fraction, clock_cycles

ROUNDS = 9


def mlp(width: int = 1024, depth: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def interleaved(methods: dict, rounds: int = ROUNDS) -> dict[str, list[float]]:
    return _interleaved(methods, rounds)


class PerCallThreads:
    """The previous scheme (torchgpipe's): new threads every call, caller waits at every clock tick."""

    def __init__(self, pipe: dk.Pipeline) -> None:
        self.pipe = pipe

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        parts, chunks = self.pipe.parts, batch.chunk(self.pipe.chunks)
        n = len(parts)
        inboxes: list[queue.Queue] = [queue.Queue() for _ in parts]
        outboxes: list[queue.Queue] = [queue.Queue() for _ in parts]

        def serve(j: int) -> None:
            while (task := inboxes[j].get()) is not None:
                outboxes[j].put(task())

        threads = [threading.Thread(target=serve, args=(j,), daemon=True) for j in range(n)]
        for t in threads:
            t.start()
        values = list(chunks)
        for tick in clock_cycles(len(values), n):
            for i, j in tick:
                inboxes[j].put(lambda i=i, j=j: parts[j](values[i]))
            for i, j in tick:
                values[i] = outboxes[j].get()
        for j, t in enumerate(threads):
            inboxes[j].put(None)
            t.join()
        return torch.cat(values)


class PartClock:
    """Busy time of each part of a naive split, from forward pre/post hooks."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.busy = [0.0] * len(parts)
        self._start = 0.0
        for i, part in enumerate(parts):
            part.register_forward_pre_hook(self._pre)
            part.register_forward_hook(lambda *_, i=i: self._post(i))

    def _pre(self, *_: object) -> None:
        self._start = time.perf_counter()

    def _post(self, i: int) -> None:
        self.busy[i] += time.perf_counter() - self._start


def part1() -> None:
    torch.set_num_threads(1)
    batch = torch.randn(512, 1024)
    print("Part 1: forward throughput, 8 x Linear(1024) + ReLU, batch 512, devices ['cpu', 'cpu'], "
          "torch.set_num_threads(1)")
    naive = dk.split(mlp(), ["cpu", "cpu"], balance=[8, 8])
    clock = PartClock(naive.parts)
    idle_naive: list[float] = []

    def run_naive() -> None:
        clock.busy = [0.0, 0.0]
        start = time.perf_counter()
        naive(batch)
        idle_naive.append(1 - sum(clock.busy) / (2 * (time.perf_counter() - start)))

    pipes = {chunks: dk.Pipeline(mlp(), ["cpu", "cpu"], chunks=chunks, balance=[8, 8], checkpoint="never")
             for chunks in (1, 2, 4, 8)}
    idles: dict[int, list[float]] = {chunks: [] for chunks in pipes}

    def run_pipe(chunks: int) -> None:
        pipe = pipes[chunks]
        pipe(batch)
        assert pipe.last_run is not None
        idles[chunks].append(pipe.last_run.idle_fraction)

    before = {chunks: PerCallThreads(pipes[chunks]) for chunks in (2, 4, 8)}
    methods = {0: run_naive, **{c: (lambda c=c: run_pipe(c)) for c in pipes},
               **{-c: (lambda c=c: before[c](batch)) for c in before}}
    with torch.no_grad():
        times = interleaved(methods)
    best = {name: min(t) for name, t in times.items()}
    median = {name: statistics.median(t) for name, t in times.items()}
    base, base_median = best[0], median[0]
    print(f"{'method':<36}{'samples/s':>10}{'ratio vs naive':>15}{'(median)':>9}"
          f"{'idle measured':>15}{'idle predicted':>16}")

    def row(name: str, key: int, idle: str, predicted: float) -> None:
        print(f"{name:<36}{len(batch) / best[key]:>10.0f}{base / best[key]:>15.2f}"
              f"{base_median / median[key]:>9.2f}{idle:>15}{predicted:>16.1%}")

    row("naive split (dk.split)", 0, f"{statistics.median(idle_naive):.1%}", bubble_fraction(1, 2))
    for chunks in pipes:
        row(f"Pipeline chunks={chunks}", chunks, f"{statistics.median(idles[chunks]):.1%}",
            bubble_fraction(chunks, 2))
    for chunks in before:
        row(f"threads per call, chunks={chunks} *", -chunks, "-", bubble_fraction(chunks, 2))
    print("* the previous scheme (torchgpipe's): new stage threads on every call, the caller waits at "
          "every clock tick; same parts, measured in the same rounds")
    # one training step, for completeness (backward is serial on CPU, see the module doc)
    train = interleaved({"naive": lambda: naive(batch).sum().backward(),
                         "pipe": lambda: pipes[4](batch).sum().backward()})
    tn, tp = min(train["naive"]), min(train["pipe"])
    print(f"training step (fwd+bwd): naive {tn * 1e3:.0f} ms, Pipeline chunks=4 "
          f"{tp * 1e3:.0f} ms, ratio {tn / tp:.2f} (best of {ROUNDS})")
    for pipe in pipes.values():
        pipe.close()
    overhead()


def overhead() -> None:
    """Fixed cost per call: a tiny model (2 x Linear(8, 8), batch 64) where the work is negligible."""
    x = torch.randn(64, 8)

    def tiny() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))

    naive = dk.split(tiny(), ["cpu", "cpu"], balance=[1, 1])
    pipes = {c: dk.Pipeline(tiny(), ["cpu", "cpu"], chunks=c, balance=[1, 1], checkpoint="never")
             for c in (1, 2, 8)}
    methods = {"naive": lambda: naive(x), **{f"pipe{c}": (lambda p=p: p(x)) for c, p in pipes.items()},
               **{f"old{c}": (lambda p=p: PerCallThreads(p)(x)) for c, p in pipes.items()}}
    with torch.no_grad():
        times = interleaved(methods, rounds=200)
    us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    print(f"per-call overhead (tiny model, median of 200, microseconds): naive split {us['naive']:.0f}; "
          + ", ".join(f"chunks={c}: Pipeline {us[f'pipe{c}']:.0f} vs threads per call {us[f'old{c}']:.0f}"
                      for c in pipes))
    for pipe in pipes.values():
        pipe.close()
    torch.set_num_threads(os.cpu_count() or 1)


def uneven_model() -> nn.Sequential:
    with torch.device("meta"):
        encoder = [nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True) for _ in range(8)]
        return nn.Sequential(nn.Embedding(32000, 512), *encoder, nn.LayerNorm(512), nn.Linear(512, 32000))


def accelerate_counts(model: nn.Module, parts: int, balanced: bool) -> list[int] | str:
    try:
        from accelerate.utils import get_balanced_memory, infer_auto_device_map
    except ImportError:
        return "accelerate not installed"
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    keep = ["TransformerEncoderLayer"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if balanced:
            budget = get_balanced_memory(model, max_memory={i: weights for i in range(parts)},
                                         no_split_module_classes=keep)
            device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=keep)
        else:  # the smallest equal budget per device that accelerate fills without spilling
            for slack in (1.05, 1.25, 1.5, 2.0, 3.0):
                budget = {i: int(weights / parts * slack) for i in range(parts)}
                device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=keep)
                if not any(isinstance(d, str) for d in device_map.values()):
                    break
    if any(isinstance(d, str) for d in device_map.values()):
        return f"spilled to {sorted({d for d in device_map.values() if isinstance(d, str)})}"
    return [sum(1 for d in device_map.values() if d == i) for i in range(parts)]


def part2() -> None:
    model = uneven_model()
    layers = sequential_layers(model)
    sample = torch.empty(8, 512, dtype=torch.long, device="meta")
    costs = [c.memory(training=True, optimizer=optimizer_factor("adam"))
             for c in profile_layers(layers, sample)]
    print()
    print("Part 2: balance of an uneven model (embedding 32000x512, 8 encoder layers, head 512x32000; "
          "meta device, batch 8 x 512 tokens), cost = training memory with adam")
    print(f"{'method':<44}{'parts':>6}  {'layers per part':<24}{'largest/mean':>13}{'ratio vs dk':>12}")
    for parts in (2, 4):
        ours = build_plan(layers, [torch.device("meta")] * parts, sample=sample).counts
        rows: list[tuple[str, list[int] | str]] = [
            ("devicekit balance='size'", ours),
            ("accelerate get_balanced_memory + device map", accelerate_counts(model, parts, True)),
            ("accelerate device map, equal budgets*", accelerate_counts(model, parts, False)),
            ("equal layer count", [len(layers) // parts + (i < len(layers) % parts) for i in range(parts)]),
        ]
        best = max_over_mean(part_costs(costs, ours))
        for name, counts in rows:
            if isinstance(counts, str):
                print(f"{name:<44}{parts:>6}  {counts}")
                continue
            value = max_over_mean(part_costs(costs, counts))
            print(f"{name:<44}{parts:>6}  {str(counts):<24}{value:>13.2f}{value / best:>12.2f}")
    print("* the smallest equal per-device budget (x1.05, 1.25, 1.5, 2, 3 of weights/parts) that "
          "accelerate fills without spilling to cpu/disk")
    print("torchgpipe balance_by_size / balance_by_time: not available (not installed), not compared")


def part3() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    encoder = [nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True) for _ in range(6)]
    model = nn.Sequential(nn.Embedding(8000, 256), *encoder, nn.Linear(256, 8000))
    sample = torch.randint(0, 8000, (8, 64))
    layers = sequential_layers(model)
    times = [c.seconds or 0.0 for c in profile_layers(layers, sample, measure_time=True)]
    print()
    print("Part 3: balance by time (embedding 8000x256, 6 encoder layers, head 256x8000; real model, "
          "batch 8 x 64 tokens), cost = measured forward+backward seconds per layer")
    print(f"{'method':<44}{'parts':>6}  {'layers per part':<24}{'largest/mean':>13}{'ratio vs dk':>12}")
    for parts in (2, 4):
        ours = build_plan(layers, [torch.device("cpu")] * parts, balance="time", sample=sample).counts
        equal = [len(layers) // parts + (i < len(layers) % parts) for i in range(parts)]
        best = max_over_mean(part_costs(times, ours))
        for name, counts in (("devicekit balance='time'", ours), ("equal layer count", equal)):
            value = max_over_mean(part_costs(times, counts))
            print(f"{name:<44}{parts:>6}  {str(counts):<24}{value:>13.2f}{value / best:>12.2f}")
    print("(devicekit re-times the layers when it plans, so its own cut is scored on a second, noisy "
          "measurement; accelerate has no time-based device map)")
    torch.set_num_threads(os.cpu_count() or 1)


def part4() -> None:
    """GPU: two stages on one GPU (``["cuda:0", "cuda:0"]``) against the naive split, forward and
    a training step, with the measured idle fraction. On one device the stages share its compute
    units, so this measures the pipeline's own cost and whether the stage threads keep the GPU
    fed, not a multi-GPU speed-up."""
    print()
    if not torch.cuda.is_available():
        print("Part 4 (two stages on one GPU): skipped, no CUDA device")
        return
    torch.set_num_threads(os.cpu_count() or 1)
    devices = ["cuda:0", "cuda:0"]
    batch = torch.randn(4096, 4096, device="cuda:0")

    def model() -> nn.Sequential:
        return mlp(width=4096, depth=8).cuda()

    naive = dk.split(model(), devices, balance=[8, 8])
    pipes = {c: dk.Pipeline(model(), devices, chunks=c, balance=[8, 8], checkpoint="never")
             for c in (1, 2, 4, 8)}
    with torch.no_grad():
        want = naive(batch)
        for pipe in pipes.values():
            torch.testing.assert_close(pipe(batch), want, rtol=2e-3, atol=2e-3)

    def synced(fn):
        def run() -> None:
            fn()
            torch.cuda.synchronize()
        return run

    idles: dict[int, list[float]] = {c: [] for c in pipes}

    def run_pipe(c: int) -> None:
        pipes[c](batch)
        torch.cuda.synchronize()
        idles[c].append(pipes[c].last_run.idle_fraction)

    methods = {0: synced(lambda: naive(batch)), **{c: (lambda c=c: run_pipe(c)) for c in pipes}}
    with torch.no_grad():
        times = interleaved(methods)
    best = {k: min(v) for k, v in times.items()}
    print(f"Part 4: {torch.cuda.get_device_name(0)}, 8 x Linear(4096) + ReLU, batch 4096, fp32 "
          f"(tf32 {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}), two stages on cuda:0; "
          f"best of {ROUNDS}")
    print()
    print("| method | forward ms | ratio vs naive split | idle measured (host clock) | idle predicted |")
    print("|---|---:|---:|---:|---:|")
    print(f"| naive split (dk.split) | {best[0] * 1e3:.2f} | 1.00 | - | - |")
    for c in pipes:
        print(f"| Pipeline chunks={c} | {best[c] * 1e3:.2f} | {best[0] / best[c]:.2f} | "
              f"{statistics.median(idles[c]):.1%} | {bubble_fraction(c, 2):.1%} |")
    train = interleaved({"naive": synced(lambda: naive(batch).sum().backward()),
                         "pipe": synced(lambda: pipes[4](batch).sum().backward())})
    tn, tp = min(train["naive"]), min(train["pipe"])
    print()
    print(f"training step (fwd+bwd): naive {tn * 1e3:.1f} ms, Pipeline chunks=4 {tp * 1e3:.1f} ms, "
          f"ratio {tn / tp:.2f}")
    print("(idle is measured on the host clock around each stage's calls; CUDA runs them "
          "asynchronously, so on a GPU it says how long each stage thread waited for work, not how "
          "busy the GPU was)")
    for pipe in pipes.values():
        pipe.close()


if __name__ == "__main__":
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
          f"torch {torch.__version__}, CUDA GPUs: {torch.cuda.device_count() if torch.cuda.is_available() else 0}, "
          f"load average {os.getloadavg()[0]:.1f} (other processes compete for the cores)")
    if not torch.cuda.is_available():
        print("(no CUDA GPU: the GPU pipeline comparison is skipped; run this on a multi-GPU machine for it)")
    part1()
    part2()
    part3()
    part4()
