"""What NVIDIA publishes about common GPU models: dense peak throughput and memory bandwidth.

A small table, matched by the name NVML reports (``"NVIDIA H100 80GB HBM3"``, ``"Tesla T4"``).
``devicekit bench`` prints its measurements beside these peaks, the capability score ranks
GPUs by them when nothing was measured, and simulated GPUs take their facts from here by name.

Peaks are **dense** (no 2:4 sparsity) tensor-core figures for tf32/bf16/fp16 (fp32 accumulate)
and plain CUDA-core fp32, in TFLOP/s, at boost clock; bandwidth is the memory interface's peak
in GB/s (1e9 bytes/s). ``None`` means the model has no such unit (T4 and V100: no bf16, no tf32)
or it is not published. Sources (NVIDIA datasheets and architecture whitepapers; where a
datasheet gives only the sparse figure, dense is half of it):

* H100 SXM5 / PCIe / NVL: "NVIDIA H100 Tensor Core GPU" datasheet (2023),
  https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
* H200 SXM / NVL: "NVIDIA H200 Tensor Core GPU" datasheet (2024), https://www.nvidia.com/en-us/data-center/h200/
* A100 SXM4 / PCIe 40 and 80 GB: "NVIDIA A100 Tensor Core GPU" datasheet (2021),
  https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf
* A10, L4, L40S: the product datasheets at https://www.nvidia.com/en-us/data-center/
* T4: "NVIDIA T4 Tensor Core GPU" datasheet; V100: "NVIDIA Tesla V100" datasheet (SXM2, PCIe)
* GeForce RTX 4090 / 3090: the Ada (2022) and Ampere GA102 (2020) whitepapers, fp16/bf16 with
  fp32 accumulate (what torch uses)

Usage::

    from devicekit.hardware.known_gpus import lookup

    model = lookup("NVIDIA H100 80GB HBM3")
    model.peak("bf16"), model.memory_bandwidth_gbs      # 989.4, 3350.0
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = ["KnownGPU", "KNOWN_GPUS", "DTYPES", "lookup"]

#: the dtypes the table gives peaks for (and ``devicekit bench`` measures)
DTYPES = ("fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True)
class KnownGPU:
    """One model's published facts."""

    model: str
    #: regular expression matched (case-insensitively, ``re.search``) against NVML's name
    pattern: str
    architecture: str
    compute_capability: tuple[int, int]
    sm_count: int
    #: boost clock of the SMs, MHz
    max_sm_clock: int
    memory_bandwidth_gbs: float
    fp32: float | None
    tf32: float | None
    bf16: float | None
    fp16: float | None

    def peak(self, dtype: str) -> float | None:
        """Dense peak TFLOP/s for ``dtype`` (one of :data:`DTYPES`), None where there is none."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return getattr(self, dtype)

    @property
    def half_peak(self) -> float:
        """The best 16-bit tensor peak (bf16, else fp16), the basis of the capability score."""
        return self.bf16 or self.fp16 or self.fp32 or 0.0


# Order matters: the first match wins, so the specific names (NVL, PCIe) come before the
# general ones.
KNOWN_GPUS: tuple[KnownGPU, ...] = (
    KnownGPU("H200 NVL", r"h200 nvl", "Hopper", (9, 0), 132, 1785, 4800, 60.0, 417.5, 835.5, 835.5),
    KnownGPU("H200 SXM", r"h200", "Hopper", (9, 0), 132, 1980, 4800, 67.0, 494.7, 989.4, 989.4),
    KnownGPU("H100 NVL", r"h100 nvl", "Hopper", (9, 0), 132, 1785, 3900, 60.0, 417.5, 835.5, 835.5),
    KnownGPU("H100 PCIe", r"h100 pcie", "Hopper", (9, 0), 114, 1755, 2000, 51.2, 378.0, 756.0, 756.0),
    KnownGPU("H100 SXM", r"h100", "Hopper", (9, 0), 132, 1980, 3350, 67.0, 494.7, 989.4, 989.4),
    KnownGPU("A100 SXM4 80GB", r"a100.*sxm4?-80gb", "Ampere", (8, 0), 108, 1410, 2039,
             19.5, 156.0, 312.0, 312.0),
    KnownGPU("A100 PCIe 80GB", r"a100 80gb pcie", "Ampere", (8, 0), 108, 1410, 1935,
             19.5, 156.0, 312.0, 312.0),
    KnownGPU("A100 40GB", r"a100", "Ampere", (8, 0), 108, 1410, 1555, 19.5, 156.0, 312.0, 312.0),
    KnownGPU("L40S", r"l40s", "Ada Lovelace", (8, 9), 142, 2520, 864, 91.6, 183.0, 362.0, 362.0),
    KnownGPU("L4", r"\bl4\b", "Ada Lovelace", (8, 9), 58, 2040, 300, 30.3, 60.0, 121.0, 121.0),
    KnownGPU("A10", r"\ba10\b", "Ampere", (8, 6), 72, 1695, 600, 31.2, 62.5, 125.0, 125.0),
    KnownGPU("RTX 4090", r"rtx 4090", "Ada Lovelace", (8, 9), 128, 2520, 1008,
             82.6, 82.6, 165.2, 165.2),
    KnownGPU("RTX 3090", r"rtx 3090", "Ampere", (8, 6), 82, 1695, 936, 35.6, 35.6, 71.0, 71.0),
    KnownGPU("V100 SXM2", r"v100-sxm2", "Volta", (7, 0), 80, 1530, 900, 15.7, None, None, 125.0),
    KnownGPU("V100 PCIe", r"v100", "Volta", (7, 0), 80, 1380, 900, 14.0, None, None, 112.0),
    KnownGPU("T4", r"\bt4\b", "Turing", (7, 5), 40, 1590, 320, 8.1, None, None, 65.0),
)


@functools.lru_cache(maxsize=256)
def lookup(name: str) -> KnownGPU | None:
    """The table's entry for the GPU NVML calls ``name``, or None for a model not in the table
    (remembered per name: a snapshot asks once per GPU, and a machine has few models)."""
    lowered = name.lower()
    for known in KNOWN_GPUS:
        if re.search(known.pattern, lowered):
            return known
    return None
