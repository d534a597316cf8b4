"""devicekit.memory: see what uses memory, find what leaks, explain an OOM, size the batch.

Usage::

    import devicekit as dk

    dk.memory.report()                      # allocated / reserved / peak / free per device
    print(dk.memory.census(top=10))         # biggest tensors by name and by shape
    report = dk.find_leaks(train_step)      # names the variable that keeps growing
    with dk.oom_guard():                    # explains an out-of-memory error in plain words
        train()
    bs = dk.find_batch_size(lambda n: train_step(batch_size=n), start=32)

Submodules: ``usage``, ``table``, ``census``, ``release``, ``leaks``, ``oom``, ``batch_size``,
``timeline``. Importing this package imports torch.
"""

from __future__ import annotations

from devicekit.memory.batch_size import BatchSize, find_batch_size
from devicekit.memory.census import Census, CensusEntry, CensusGroup, census
from devicekit.memory.leaks import Leak, LeakDetector, LeakReport, find_leaks
from devicekit.memory.oom import install_oom_handler, oom_guard
from devicekit.memory.release import Released, empty_cache, release
from devicekit.memory.table import report
from devicekit.memory.timeline import MemoryTimeline, TimelineSample
from devicekit.memory.usage import DeviceMemory, usage

__all__ = [
    "Census", "CensusEntry", "CensusGroup", "DeviceMemory", "MemoryTimeline", "Released", "TimelineSample",
    "BatchSize", "Leak", "LeakDetector", "LeakReport",
    "census", "empty_cache", "find_batch_size", "find_leaks", "install_oom_handler", "oom_guard",
    "release", "report", "usage",
]
