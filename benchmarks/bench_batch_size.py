"""Batch-size search: trials needed and how close the answer lands, devicekit vs accelerate.

Each case hides a limit: the trial function raises a CUDA-style OutOfMemoryError above it
(this is a CPU machine; the search logic is what is compared). devicekit's
``find_batch_size`` doubles then bisects; accelerate's ``find_executable_batch_size`` starts
at ``starting_batch_size`` and multiplies by 0.9 on every failure, never growing. Both start
from the same size. "answer / limit" is how much of the real capacity each would use.

Run: python benchmarks/bench_batch_size.py  (a few seconds)
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's devicekit

import torch  # noqa: E402

import devicekit as dk  # noqa: E402

CASES = [  # (hidden limit, start)
    (37, 128), (100, 128), (200, 128), (1000, 128), (3000, 128), (12_345, 128), (50, 4096), (700, 4096),
]


class HiddenLimit:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.calls = 0

    def __call__(self, batch_size: int) -> int:
        self.calls += 1
        if batch_size > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch_size} MiB.")
        return batch_size


def accelerate_search(limit: int, start: int) -> tuple[int, int]:
    from accelerate.utils import find_executable_batch_size

    trial = HiddenLimit(limit)

    @find_executable_batch_size(starting_batch_size=start)
    def run(batch_size: int) -> int:
        return trial(batch_size)

    return run(), trial.calls


def devicekit_search(limit: int, start: int) -> tuple[int, int]:
    trial = HiddenLimit(limit)
    found = dk.find_batch_size(trial, start=start)
    return int(found), trial.calls


def main() -> None:
    logging.getLogger("devicekit").setLevel(logging.WARNING)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, no GPU (simulated OOM above a hidden limit)")
    print()
    print("| hidden limit | start | devicekit answer | trials | answer/limit | accelerate answer | trials | answer/limit |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    totals = {"dk": [0, 0.0], "acc": [0, 0.0]}
    for limit, start in CASES:
        dk_answer, dk_trials = devicekit_search(limit, start)
        acc_answer, acc_trials = accelerate_search(limit, start)
        totals["dk"][0] += dk_trials
        totals["dk"][1] += dk_answer / limit
        totals["acc"][0] += acc_trials
        totals["acc"][1] += acc_answer / limit
        print(f"| {limit} | {start} | {dk_answer} | {dk_trials} | {dk_answer / limit:.0%} | "
              f"{acc_answer} | {acc_trials} | {acc_answer / limit:.0%} |")
    n = len(CASES)
    print(f"| **mean** | | | {totals['dk'][0] / n:.1f} | {totals['dk'][1] / n:.0%} | | "
          f"{totals['acc'][0] / n:.1f} | {totals['acc'][1] / n:.0%} |")
    print()
    print(f"capacity used, devicekit / accelerate: {totals['dk'][1] / totals['acc'][1]:.2f}x; "
          f"trials, devicekit / accelerate: {totals['dk'][0] / totals['acc'][0]:.2f}x")


def gpu_part() -> None:
    """The same comparison against real GPU memory (limited to about 2 GiB), when there is a GPU."""
    print()
    if not torch.cuda.is_available():
        print("GPU part skipped: no CUDA device on this machine")
        return
    import gc
    import time

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(0.9, 2 * 2**30 / total), 0)
    unit = 16 * 2**20

    def trial(n: int) -> int:
        x = torch.empty(n * unit, dtype=torch.uint8, device="cuda:0")
        y = x.clone()
        del x, y
        return n

    try:
        began = time.perf_counter()
        found = dk.find_batch_size(trial, start=8)
        dk_seconds = time.perf_counter() - began
        gc.collect()
        torch.cuda.empty_cache()
        from accelerate.utils import find_executable_batch_size

        calls = []

        @find_executable_batch_size(starting_batch_size=256)
        def run(batch_size: int) -> int:
            calls.append(batch_size)
            return trial(batch_size)

        began = time.perf_counter()
        acc = run()
        acc_seconds = time.perf_counter() - began
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    print(f"GPU ({torch.cuda.get_device_name(0)}, limited to 2 GiB): real limit {int(found)} "
          f"(devicekit, {len(found.trials)} trials, {dk_seconds:.2f} s); accelerate from 256: "
          f"{acc} ({len(calls)} trials, {acc_seconds:.2f} s, {acc / found:.0%} of the limit)")


def real_model_part() -> None:
    """find_batch_size on a real training step: a 6-layer transformer encoder (d_model 1024,
    sequence 256, Adam), GPU memory limited to 8 GiB. The true limit is checked afterwards: the
    answer must fit and answer + 1 must not, each tried on a clean allocator."""
    print()
    if not torch.cuda.is_available():
        print("real-model GPU part skipped: no CUDA device on this machine")
        return
    import gc
    import time

    from torch import nn

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True)
    model = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).cuda()
    opt = torch.optim.Adam(model.parameters())

    def trial(batch_size: int) -> int:
        x = torch.randn(batch_size, 256, 1024, device="cuda:0")
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return batch_size

    def fits(batch_size: int) -> bool:
        gc.collect()
        torch.cuda.empty_cache()
        try:
            trial(batch_size)
            return True
        except torch.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            return False

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(0.9, 8 * 2**30 / total), 0)
    try:
        trial(1)  # Adam's state exists before the search, as in a real run's second step
        began = time.perf_counter()
        found = dk.find_batch_size(trial, start=8)
        dk_seconds = time.perf_counter() - began
        exact = fits(int(found)) and not fits(int(found) + 1)
        from accelerate.utils import find_executable_batch_size

        calls: list[int] = []

        @find_executable_batch_size(starting_batch_size=512)
        def run(batch_size: int) -> int:
            calls.append(batch_size)
            return trial(batch_size)

        gc.collect()
        torch.cuda.empty_cache()
        began = time.perf_counter()
        acc = run()
        acc_seconds = time.perf_counter() - began
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    print(f"GPU ({torch.cuda.get_device_name(0)}, limited to 8 GiB), transformer encoder 6 x 1024, "
          f"seq 256, Adam:")
    print()
    print("| method | answer | share of the true limit | trials | seconds |")
    print("|---|---:|---:|---:|---:|")
    print(f"| dk.find_batch_size(start=8) | {int(found)} | 100 % (exact: {found} fits, "
          f"{int(found) + 1} does not: {'confirmed' if exact else 'NOT confirmed'}) | "
          f"{len(found.trials)} | {dk_seconds:.2f} |")
    print(f"| accelerate find_executable_batch_size(512) | {acc} | {acc / int(found):.0%} | "
          f"{len(calls)} | {acc_seconds:.2f} |")


if __name__ == "__main__":
    main()
    gpu_part()
    real_model_part()
