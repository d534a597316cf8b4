"""Memory over time: one sample per step, a PNG plot, and on CUDA a snapshot for memory_viz.

On CUDA each sample holds the allocator's allocated and reserved bytes, and (``history=True``)
torch's allocator history is recorded, so :meth:`MemoryTimeline.save_snapshot` writes a pickle
that https://pytorch.org/memory_viz opens (every allocation with its stack). On CPU each sample
holds the process's resident memory and, with ``count_tensors=True``, the bytes of live CPU
tensors (a garbage-collector walk per step: slower). :meth:`MemoryTimeline.plot` needs
matplotlib (``pip install 'devicekit[plot]'``); without it the error says so.

Usage::

    import devicekit as dk
    from devicekit.memory.timeline import MemoryTimeline

    with MemoryTimeline() as tl:
        for batch in loader:
            train_step(batch)
            tl.step()
    tl.plot("memory.png")
    if torch.cuda.is_available():
        tl.save_snapshot("memory.pickle")     # drag into pytorch.org/memory_viz
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from devicekit.errors import BackendError, InvalidValueError, MissingDependencyError
from devicekit.memory.tensors import live_tensors, total_bytes

__all__ = ["MemoryTimeline", "TimelineSample"]


@dataclass(frozen=True)
class TimelineSample:
    step: int
    seconds: float
    label: str | None
    allocated: int | None  # CUDA: allocator; CPU: live tensor bytes (count_tensors) else None
    reserved: int | None  # CUDA only
    rss: int | None  # process resident memory


def _history_enabled() -> bool:
    """Whether the CUDA allocator history is already being recorded (by the user or a tool)."""
    check = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


class MemoryTimeline:
    """Record memory per step; see the module docstring."""

    def __init__(self, device: str | int | torch.device | None = None, *, history: bool = True,
                 max_entries: int = 100_000, count_tensors: bool = False) -> None:
        if device is None:
            device = (f"cuda:{torch.cuda.current_device()}"
                      if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu")
        try:
            self.device = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
        except (RuntimeError, TypeError):
            raise InvalidValueError(f"device {device!r} is not a device; write e.g. 'cuda:0' or 'cpu'") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidValueError(f"device {device!r} asked but CUDA is not available; use 'cpu'")
        self.history = history and self.device.type == "cuda"
        self.max_entries = max_entries
        self.count_tensors = count_tensors
        self.samples: list[TimelineSample] = []
        self._t0 = 0.0
        self._recording = False
        self._owns_history = False
        self._step = 0

    def __enter__(self) -> MemoryTimeline:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self._t0 = time.perf_counter()
        if self.history and not self._recording:
            if _history_enabled():  # someone else records: share it, and leave it on at stop()
                self._recording, self._owns_history = True, False
            else:
                torch.cuda.memory._record_memory_history(max_entries=self.max_entries)
                self._recording, self._owns_history = True, True
        self.samples.append(self._sample(None))

    def stop(self) -> None:
        """Stop recording the allocator history (the recorded part stays for the snapshot)."""
        if self._recording:
            self._snapshot = torch.cuda.memory._snapshot()
            if self._owns_history:
                torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False

    def step(self, label: str | None = None) -> TimelineSample:
        """Record one sample (call once per step)."""
        if not self.samples:
            self.start()
        self._step += 1
        sample = self._sample(label)
        self.samples.append(sample)
        return sample

    def _sample(self, label: str | None) -> TimelineSample:
        import psutil

        rss = psutil.Process(os.getpid()).memory_info().rss
        seconds = time.perf_counter() - self._t0
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            return TimelineSample(self._step, seconds, label, torch.cuda.memory_allocated(index),
                                  torch.cuda.memory_reserved(index), rss)
        tensors = (total_bytes(t for t in live_tensors() if t.device.type == "cpu")
                   if self.count_tensors else None)
        return TimelineSample(self._step, seconds, label, tensors, None, rss)

    def to_dict(self) -> dict[str, Any]:
        return {"device": str(self.device), "samples": [asdict(s) for s in self.samples]}

    def save_json(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        os.replace(tmp, path)
        return path

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """Save a PNG of the samples (MiB per step); needs matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            raise MissingDependencyError(
                "plotting needs matplotlib, which is not installed; pip install 'devicekit[plot]'"
            ) from None
        if not self.samples:
            raise InvalidValueError("the timeline has no samples; call step() in your loop before plot()")
        steps = [s.step for s in self.samples]
        figure, axes = plt.subplots(figsize=(8, 4))
        series = {"allocated": [s.allocated for s in self.samples],
                  "reserved": [s.reserved for s in self.samples],
                  "process RSS": [s.rss for s in self.samples]}
        if self.device.type == "cpu" and self.count_tensors:
            series["live CPU tensors"] = series.pop("allocated")
        for name, values in series.items():
            if all(v is not None for v in values):
                axes.plot(steps, [v / 2**20 for v in values], label=name, marker="." if len(steps) < 50 else None)
        axes.set_xlabel("step")
        axes.set_ylabel("MiB")
        axes.set_title(title or f"memory on {self.device}")
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        path = Path(path)
        figure.savefig(path, format="png", dpi=100)
        plt.close(figure)
        return path

    def save_snapshot(self, path: str | Path) -> Path:
        """Write the CUDA allocator history as a pickle for https://pytorch.org/memory_viz."""
        if self.device.type != "cuda":
            raise BackendError(
                f"an allocator snapshot needs a CUDA device, this timeline is on {self.device}; use plot() on CPU"
            )
        import pickle

        snapshot = getattr(self, "_snapshot", None) if not self._recording else torch.cuda.memory._snapshot()
        if snapshot is None:
            snapshot = torch.cuda.memory._snapshot()
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as handle:
            pickle.dump(snapshot, handle)
        os.replace(tmp, path)
        return path
