"""The bundled example: a small model trained on synthetic data for a few seconds.

It runs as a plain process, under torchrun or ``devicekit run`` (DDP over gloo on the CPU,
nccl on GPUs, set up by ``dk.dist.init``) and under ``dk.launch``. Rank 0 prints the device
it chose and why, steps per second, peak memory and the final loss.

Usage::

    python -m devicekit.examples                  # ~3 s on the best device
    python -m devicekit.examples --seconds 1
    devicekit run --procs 2                       # 2 CPU processes, DDP over gloo
    devicekit run --gpus 2                        # 2 leased GPUs, DDP over nccl
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from dataclasses import dataclass

__all__ = ["TrainResult", "train", "main", "SECONDS_ENV"]

#: default for --seconds (lets CI make `devicekit run` with no command quicker)
SECONDS_ENV = "DEVICEKIT_EXAMPLE_SECONDS"


@dataclass(frozen=True)
class TrainResult:
    """What one run measured (the same on every rank, except ``device``)."""

    device: str
    why: str
    world_size: int
    steps: int
    seconds: float
    steps_per_second: float
    peak_memory: int
    final_loss: float


#: untimed steps before the clock starts
WARMUP_STEPS = 3


def _device_reason(device: object) -> str:
    import torch

    from devicekit.parallel import dist

    facts = dist.env()
    if getattr(device, "type", "cpu") == "cuda":
        index = torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<all>")
        return (f"{name}, local rank {facts.local_rank} of {facts.local_world_size} on this node;"
                f" CUDA_VISIBLE_DEVICES={visible}")
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    return "torch sees no CUDA device (none visible or none leased)"


def _peak_memory(device: object) -> int:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def train(seconds: float = 3.0, steps: int | None = None, batch_size: int = 128,
          width: int = 128, backend: str = "auto", seed: int = 0) -> TrainResult:
    """Train an MLP on a synthetic regression task until ``steps`` or ``seconds`` run out.

    Under several ranks the stop decision is agreed every few steps (a MAX all-reduce), so
    every rank runs the same number of steps and no collective is left waiting.
    """
    import torch
    from torch import nn

    from devicekit.parallel import dist

    device = dist.init(backend)
    facts = dist.env()
    world = facts.world_size
    torch.manual_seed(seed)
    model: nn.Module = nn.Sequential(
        nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
    ).to(device)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(seed + 1 + facts.rank)  # each rank: its own data
    teacher = torch.randn(32, 1, generator=torch.Generator().manual_seed(seed))
    batches = []
    for _ in range(16):  # a small pool of batches, made once: the loop measures training only
        inputs = torch.randn(batch_size, 32, generator=generator)
        noise = 0.1 * torch.randn(batch_size, 1, generator=generator)
        batches.append((inputs.to(device), ((inputs @ teacher).tanh() + noise).to(device)))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stop_flag = torch.zeros(1, device=device)
    loss = torch.zeros((), device=device)
    # warm-up, not timed: the first steps load torch's lazy parts (the optimizer's compile
    # checks import torch._dynamo, ~2 s on a small machine) and would halve a 3 s measurement
    for inputs, targets in batches[:WARMUP_STEPS]:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    done = 0
    start = time.perf_counter()
    while True:
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = batches[done % len(batches)]
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        done += 1
        if steps is not None:
            if done >= steps:
                break
            continue
        if done % 10 == 0:
            stop_flag.fill_(1.0 if time.perf_counter() - start >= seconds else 0.0)
            if world > 1:
                import torch.distributed as tdist

                tdist.all_reduce(stop_flag, op=tdist.ReduceOp.MAX)
            if stop_flag.item() > 0:
                break
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    final = float(dist.all_reduce_mean(loss.detach()))
    return TrainResult(
        device=str(device),
        why=_device_reason(device),
        world_size=world,
        steps=done,
        seconds=elapsed,
        steps_per_second=done / elapsed if elapsed > 0 else float("inf"),
        peak_memory=_peak_memory(device),
        final_loss=final,
    )


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m devicekit.examples [--seconds S | --steps N]``."""
    from devicekit.parallel import dist
    from devicekit.units import format_size

    parser = argparse.ArgumentParser(prog="python -m devicekit.examples", description=__doc__.split("\n")[0])
    default_seconds = float(os.environ.get(SECONDS_ENV, "3") or 3)
    parser.add_argument("--seconds", type=float, default=default_seconds,
                        help=f"train this long (default 3, or ${SECONDS_ENV})")
    parser.add_argument("--steps", type=int, default=None, help="train exactly this many steps")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--backend", default="auto", help="auto, nccl or gloo")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or (args.steps is not None and args.steps < 1):
        parser.error("--seconds must be > 0 and --steps >= 1")
    result = train(args.seconds, args.steps, args.batch_size, args.width, args.backend)
    kind = "peak GPU memory" if result.device.startswith("cuda") else "peak process memory (RSS)"
    dist.print0(f"device: {result.device} ({result.why})")
    dist.print0(f"ranks: {result.world_size}  steps: {result.steps} in {result.seconds:.2f} s"
                f"  ({result.steps_per_second:.1f} steps/s per rank)")
    dist.print0(f"{kind}: {format_size(result.peak_memory)}")
    dist.print0(f"final loss: {result.final_loss:.4g}")
    dist.destroy()
    return 0
