"""Data-parallel overhead: dk.ddp vs hand-written DistributedDataParallel, and on 2+ GPUs
BalancedDataParallel vs nn.DataParallel (device-0 memory and step time).

Run: PYTHONPATH=src python benchmarks/bench_data_parallel.py   (about 20 s on a 2-core CPU)

CPU part: two gloo ranks train the same MLP, alternating rounds of steps through a model set up
by ``dk.ddp`` + ``dk.distributed_loader`` + ``dk.epochs`` and one set up by hand
(``DistributedDataParallel`` + ``DistributedSampler`` + ``set_epoch``). The ratio is
hand-written time / devicekit time per step (1.0 = devicekit adds nothing).
GPU part (needs 2 GPUs, skipped otherwise): peak memory on device 0 and step time of
BalancedDataParallel against nn.DataParallel with the loss computed on device 0.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import devicekit as dk

ROUNDS = 7
STEPS_PER_ROUND = 40


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def _timed_steps(model: nn.Module, loader: Any, epoch_iter: Any) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    start = time.perf_counter()
    for _ in epoch_iter:
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            steps += 1
    return (time.perf_counter() - start) / steps


def ddp_rounds() -> dict[str, list[float]]:
    """Runs in each gloo rank: alternate devicekit and hand-written rounds."""
    data = TensorDataset(torch.randn(STEPS_PER_ROUND * 2 * 32, 64),
                         torch.randint(0, 10, (STEPS_PER_ROUND * 2 * 32,)))
    kit_model = dk.ddp(_net())
    kit_loader = dk.distributed_loader(data, batch_size=32)
    hand_model = DistributedDataParallel(_net(), device_ids=None)
    sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank())
    hand_loader = DataLoader(data, batch_size=32, sampler=sampler)

    def hand_epochs(n: int, start: int) -> Any:
        for epoch in range(start, n):
            sampler.set_epoch(epoch)
            yield epoch

    times: dict[str, list[float]] = {"devicekit": [], "hand": []}
    for r in range(ROUNDS + 1):  # round 0 warms up both
        kit = _timed_steps(kit_model, kit_loader, dk.epochs(kit_loader, r + 1, start=r))
        hand = _timed_steps(hand_model, hand_loader, hand_epochs(r + 1, r))
        if r:
            times["devicekit"].append(kit)
            times["hand"].append(hand)
    return times


def gpu_part() -> list[str]:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"GPU part skipped: needs 2 CUDA GPUs, found {found}"]
    ids = list(range(torch.cuda.device_count()))
    x = torch.randn(256, 1024)
    y = torch.randint(0, 32000, (256,))

    def run(make: Any, steps: int = 10) -> tuple[float, int]:
        model = make()
        torch.cuda.synchronize()
        for i in ids:
            torch.cuda.reset_peak_memory_stats(i)
        start = time.perf_counter()
        for _ in range(steps):
            model.zero_grad()
            model_loss(model)(x, y).backward()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps, torch.cuda.max_memory_allocated(0)

    def lm_head() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 32000))

    def model_loss(model: Any) -> Any:
        if isinstance(model, dk.BalancedDataParallel):
            return model
        return lambda a, b: nn.functional.cross_entropy(model(a), b.cuda(0))

    dp_time, dp_mem = run(lambda: nn.DataParallel(lm_head().cuda(0), device_ids=ids))
    bdp_time, bdp_mem = run(lambda: dk.BalancedDataParallel(lm_head(), nn.CrossEntropyLoss(),
                                                            device_ids=ids))
    return [f"| BalancedDataParallel vs nn.DataParallel, {len(ids)} GPUs | "
            f"step {bdp_time * 1e3:.1f} ms vs {dp_time * 1e3:.1f} ms | "
            f"ratio {dp_time / bdp_time:.2f} |",
            f"| device-0 peak memory | {bdp_mem / 2**20:.0f} MiB vs {dp_mem / 2**20:.0f} MiB | "
            f"ratio {dp_mem / bdp_mem:.2f} |"]


def main() -> None:
    start = time.perf_counter()
    per_rank = dk.launch(ddp_rounds, nprocs=2, devices="cpu", timeout=120)
    kit = statistics.median(t for r in per_rank for t in r["devicekit"])
    hand = statistics.median(t for r in per_rank for t in r["hand"])
    print("machine: ", torch.__version__, f"{torch.get_num_threads()} threads,",
          "CUDA" if torch.cuda.is_available() else "no GPU")
    print("| what | devicekit | anchor (hand-written torch) | ratio anchor/devicekit |")
    print("|---|---|---|---|")
    print(f"| DDP train step, 2 gloo CPU ranks, MLP 64-256-256-10, batch 32 "
          f"(median of {ROUNDS} rounds x {STEPS_PER_ROUND} steps) | {kit * 1e3:.2f} ms | "
          f"{hand * 1e3:.2f} ms | {hand / kit:.3f} |")
    for line in gpu_part():
        print(line)
    print(f"total wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
