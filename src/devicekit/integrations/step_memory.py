"""Per-step memory figures for a training framework's logger: cheap, no device synchronisation.

On CUDA: the caching allocator's allocated, reserved and peak-allocated bytes of the current
device (host-side counters: reading them never waits for the GPU). On the CPU: the process's
resident memory and its peak (``/proc`` and ``getrusage``; live CPU tensors are not counted,
that needs a garbage-collector walk per step). Values are MiB, as floats, so every logger
(CSV, TensorBoard, W&B) takes them as they are. Each reading is also kept, a bounded number of
them, for the memory plot of an out-of-memory bundle.

Usage::

    from devicekit.integrations.step_memory import StepMemory

    memory = StepMemory(prefix="devicekit/")
    for step, batch in enumerate(loader, 1):
        train_step(batch)
        logger.log(memory.read(step))     # {"devicekit/rss_mib": 812.4, "devicekit/peak_rss_mib": 830.1}
    memory.samples                         # [(step, allocated, reserved, rss), ...] in bytes
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import torch

from devicekit.memory.usage import peak_rss as memory_peak_rss

__all__ = ["StepMemory", "MIB"]

MIB = float(1 << 20)


class StepMemory:
    """Read memory once per logged step; see the module docstring.

    ``device``: a CUDA device reads the allocator, anything else the process (default: the
    current CUDA device when CUDA is initialised, else the CPU). ``keep``: how many readings stay
    for the plot (the oldest are dropped).
    """

    def __init__(self, device: torch.device | str | None = None, *, prefix: str = "devicekit/",
                 keep: int = 10_000) -> None:
        if device is None:
            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.device = torch.device(device)
        self.prefix = prefix
        self.samples: deque[tuple[int, int | None, int | None, int]] = deque(maxlen=keep)
        self._process: Any = None

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _rss(self) -> int:
        if self._process is None:
            import psutil

            self._process = psutil.Process(os.getpid())
        return int(self._process.memory_info().rss)

    def read(self, step: int) -> dict[str, float]:
        """The figures now, in MiB under ``prefix``; the reading is kept for the plot."""
        rss = self._rss()
        p = self.prefix
        if self.on_cuda:
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            allocated = torch.cuda.memory_allocated(index)
            reserved = torch.cuda.memory_reserved(index)
            peak = torch.cuda.max_memory_allocated(index)
            self.samples.append((step, allocated, reserved, rss))
            return {f"{p}allocated_mib": allocated / MIB, f"{p}reserved_mib": reserved / MIB,
                    f"{p}peak_allocated_mib": peak / MIB}
        self.samples.append((step, None, None, rss))
        figures = {f"{p}rss_mib": rss / MIB}
        peak_rss = memory_peak_rss()
        if peak_rss is not None:
            figures[f"{p}peak_rss_mib"] = max(peak_rss, rss) / MIB  # the kernel updates it lazily
        return figures
