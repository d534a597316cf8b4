"""Which GPUs exist right now: picks the backend (simulated, NVML or none) and snapshots it.

``DEVICEKIT_SIMULATE=PATH`` selects the simulated backend; otherwise NVML is used when the
driver library loads; otherwise there are no GPUs. No torch import, no subprocess, no sleeps.

Usage::

    import devicekit as dk

    for gpu in dk.gpus():
        print(gpu.index, gpu.name, f"{gpu.memory_free / 2**30:.1f} GiB free")
"""

from __future__ import annotations

import os
from typing import Protocol

from devicekit.hardware.gpu import GPU

__all__ = ["Backend", "NoBackend", "backend", "gpus", "SIMULATE_ENV"]

SIMULATE_ENV = "DEVICEKIT_SIMULATE"


class Backend(Protocol):
    """A source of GPU facts."""

    name: str

    def snapshot(self) -> list[GPU]: ...

    def driver_version(self) -> str | None: ...


class NoBackend:
    """No GPU driver on this machine: no GPUs. ``reason`` says why (shown by ``doctor``)."""

    name = "none"

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def snapshot(self) -> list[GPU]:
        return []

    def driver_version(self) -> str | None:
        return None


_cache: dict[str, Backend] = {}


def backend() -> Backend:
    """The backend in force: simulated if ``DEVICEKIT_SIMULATE`` is set, else NVML, else none."""
    sim = os.environ.get(SIMULATE_ENV)
    key = f"sim:{sim}" if sim else "nvml"
    found = _cache.get(key)
    if found is None:
        if sim:
            from devicekit.hardware.simulated import SimulatedBackend

            found = SimulatedBackend(sim)
        else:
            found = _nvml_or_none()
        _cache[key] = found
    return found


def _nvml_or_none() -> Backend:
    from devicekit.hardware import nvml

    try:
        return nvml.NVMLBackend()
    except nvml.NVMLNotFound as exc:  # no driver library: a machine without NVIDIA GPUs
        return NoBackend(str(exc))


def gpus() -> list[GPU]:
    """Snapshot every physical GPU, in NVML (PCI bus) order; ``[]`` when there are none."""
    return backend().snapshot()
