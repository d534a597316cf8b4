"""A plain torchrun-style DDP training script (torch only) used by bench_launch.py.

It knows nothing of devicekit: the same file runs under ``devicekit run``, ``torchrun`` and
``accelerate launch``. Rank 0 writes JSON with the wall-clock time of the first finished step
and the steady-state steps per second (from the median step time) to the path given as the first argument.

Usage::

    torchrun --nproc-per-node 2 benchmarks/ddp_workload.py out.json 200
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 200
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 1)).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 64, device=device)
    y = torch.randn(64, 1, device=device)
    first_step = None
    warmup = 10
    durations = []
    for step in range(steps):
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if use_cuda:
            torch.cuda.synchronize()
        if first_step is None:
            first_step = time.time()
        if step >= warmup:
            durations.append(time.perf_counter() - began)
    # the median step: robust to the pauses a shared machine inflicts on a few steps
    rate = 1.0 / statistics.median(durations)
    if dist.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump({"first_step": first_step, "steps_per_second": rate,
                       "world": dist.get_world_size()}, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
