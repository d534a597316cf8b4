"""What one physical GPU looks like at one instant: a frozen snapshot, no torch, no NVML.

Backends (NVML, simulated) build these; selection, leases, ``status`` and ``doctor`` read them,
so everything works the same on simulated GPUs as on real ones.

Usage::

    import devicekit as dk

    for gpu in dk.gpus():
        print(gpu.index, gpu.name, gpu.memory_free, gpu.utilization)
        for proc in gpu.processes:
            print("  ", proc.pid, proc.user, proc.command)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["GPU", "GPUProcess", "MigDevice"]


@dataclass(frozen=True)
class GPUProcess:
    """A process holding memory on a GPU."""

    pid: int
    user: str | None = None
    command: str | None = None
    #: GPU memory the process holds, in bytes (None where the driver will not say).
    memory: int | None = None


@dataclass(frozen=True)
class MigDevice:
    """One MIG instance of a GPU in MIG mode."""

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int

    @property
    def memory_free(self) -> int:
        return max(self.memory_total - self.memory_used, 0)


@dataclass(frozen=True)
class GPU:
    """A snapshot of one physical GPU.

    ``index`` is the physical index as NVML counts (PCI bus order), which is what
    ``CUDA_VISIBLE_DEVICES`` means when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; prefer ``uuid``.

    ``utilization`` is the percentage of time a kernel was running (averaged over a short
    window where the backend can), *not* a share of capacity: a GPU at 100 % may still have
    room. ``memory_bandwidth_utilization`` is the percentage of time device memory was being
    read or written. Memory figures are bytes.
    """

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    memory_free: int
    pci_bus_id: str | None = None
    utilization: float | None = None
    memory_bandwidth_utilization: float | None = None
    temperature: int | None = None
    power_draw: float | None = None
    power_limit: float | None = None
    compute_capability: tuple[int, int] | None = None
    compute_mode: str | None = None
    mig_enabled: bool = False
    mig_devices: tuple[MigDevice, ...] = ()
    processes: tuple[GPUProcess, ...] = ()
    #: speed facts (NVML, the simulation file, or the known-model table by name); None: unknown
    architecture: str | None = None
    sm_count: int | None = None
    #: boost clock of the SMs, MHz
    max_sm_clock: int | None = None
    #: peak memory bandwidth, GB/s (1e9 bytes/s)
    memory_bandwidth: float | None = None
    #: where the numbers came from: "nvml" or "simulated"
    backend: str = "nvml"
    #: set when this is one MIG instance of a GPU in MIG mode, as selection hands it out
    #: (:func:`devicekit.hardware.mig.leasable_devices`): the parent GPU's UUID and the
    #: instance's position among the parent's ``mig_devices``; ``index`` is the parent's
    parent_uuid: str | None = None
    mig_index: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_mig(self) -> bool:
        """True for one MIG instance (a ``MIG-`` UUID), False for a physical GPU."""
        return self.parent_uuid is not None

    @property
    def label(self) -> str:
        """``GPU 2``, or ``GPU 2 MIG 1`` for a MIG instance: how messages name it."""
        return f"GPU {self.index}" + (f" MIG {self.mig_index}" if self.is_mig else "")

    @property
    def short_uuid(self) -> str:
        """The first 8 hex digits after ``GPU-``, as accepted by ``CUDA_VISIBLE_DEVICES``."""
        return self.uuid[4:12] if self.uuid.startswith("GPU-") else self.uuid[:8]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the schema of ``devicekit status --json``, see docs/cli.md)."""
        data = asdict(self)
        data.pop("extra", None)
        if self.parent_uuid is None:  # a physical GPU: the status schema has no such keys
            data.pop("parent_uuid")
            data.pop("mig_index")
        data["compute_capability"] = (
            f"{self.compute_capability[0]}.{self.compute_capability[1]}"
            if self.compute_capability
            else None
        )
        return data
