"""Matmul throughput per dtype and size, and where a GPU overtakes the CPU (D2L exercise 1).

``fp32`` is plain fp32 (TF32 off), ``tf32`` is fp32 tensors on tensor cores (TF32 on), ``bf16``
and ``fp16`` are 16-bit inputs. Throughput counts ``2 n^3`` FLOPs per ``n x n`` product, timed
by :func:`~devicekit.measure.timing.median_seconds` on random inputs. The crossover is timed the
way a user meets it: one product, issued and waited for (``wall_seconds``), on each device.

Usage::

    from devicekit.measure.matmul import matmul_tflops, crossover

    matmul_tflops(torch.device("cuda:0"), "bf16", 8192)      # e.g. 720.5
    crossover(torch.device("cuda:0"), sizes=(16, 64, 256, 1024))
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator, Sequence

import torch

from devicekit.measure.timing import median_seconds, on_device, wall_seconds

__all__ = ["DTYPES", "matmul_tflops", "crossover", "supported_dtypes"]

DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16}


@contextlib.contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def supported_dtypes(device: torch.device) -> list[str]:
    """The dtypes worth measuring here: CPU fp32 only; TF32 and bf16 from Ampere (8.0) on."""
    if device.type != "cuda":
        return ["fp32"]
    major, _ = torch.cuda.get_device_capability(device)
    return ["fp32", "tf32", "bf16", "fp16"] if major >= 8 else ["fp32", "fp16"]


def matmul_tflops(device: torch.device, dtype: str, n: int) -> float:
    """Measured TFLOP/s of ``n x n @ n x n`` in ``dtype`` on ``device``."""
    with on_device(device):
        a = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
        b = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
        out = torch.empty(n, n, device=device, dtype=DTYPES[dtype])
        with _tf32(dtype == "tf32"):
            seconds = median_seconds(lambda: torch.mm(a, b, out=out), device)
    return 2.0 * n**3 / seconds / 1e12


def _one_product_seconds(device: torch.device, n: int, repeats: int = 5) -> float:
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    with on_device(device), _tf32(False):
        for _ in range(2):
            wall_seconds(lambda: a @ b, device)
        return statistics.median(wall_seconds(lambda: a @ b, device) for _ in range(repeats))


def crossover(gpu: torch.device, sizes: Sequence[int]) -> tuple[int | None, list[dict[str, float]]]:
    """The smallest size at which one fp32 product, waited for, is faster on ``gpu`` than on
    the CPU (None if never, among ``sizes``), and the per-size seconds on both."""
    rows = []
    found: int | None = None
    for n in sizes:
        cpu = _one_product_seconds(torch.device("cpu"), n)
        dev = _one_product_seconds(gpu, n)
        rows.append({"n": n, "cpu_seconds": cpu, "gpu_seconds": dev})
        if found is None and dev < cpu:
            found = n
    return found, rows
