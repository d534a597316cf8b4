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

from devicekit.memory.census import Census, CensusEntry, CensusGroup, census
from devicekit.memory.release import Released, empty_cache, release
from devicekit.memory.table import report
from devicekit.memory.timeline import MemoryTimeline, TimelineSample
from devicekit.memory.usage import DeviceMemory, usage

__all__ = [
    "Census", "CensusEntry", "CensusGroup", "DeviceMemory", "MemoryTimeline", "Released", "TimelineSample",
    "census", "empty_cache", "release", "report", "usage",
]
