"""One doctor check's result (:class:`Check`) and the GPU facts every check reads (:class:`Inventory`).

The checks themselves live in :mod:`devicekit.sharing.doctor_checks` (driver, GPUs, variables,
leases), :mod:`devicekit.hardware.torch_checks` (torch build, NCCL) and
:mod:`devicekit.hardware.launcher_checks` (torchrun/Slurm/MPI variables); all of them import
these types from here. No torch import.

Usage::

    from devicekit.hardware.check_result import Check, take_inventory

    inv = take_inventory()                      # read the backend once
    line = Check("gpus", "pass", f"{len(inv.gpus)} GPU(s)")
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Literal

from devicekit.errors import DeviceKitError
from devicekit.hardware.gpu import GPU

__all__ = ["Check", "Inventory", "Status", "STATUSES", "take_inventory"]

Status = Literal["pass", "warn", "fail", "skip"]
STATUSES: tuple[Status, ...] = ("pass", "warn", "fail", "skip")


@dataclass(frozen=True)
class Check:
    """One doctor line: ``name`` (what was checked), ``status`` and a one-line ``message``."""

    name: str
    status: Status
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Inventory:
    """What the checks need to know about the GPUs, taken once."""

    backend: str
    gpus: tuple[GPU, ...]
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    nvml_version: str | None = None
    #: why there are no GPUs facts (NVML missing or failing), if so
    problem: str | None = None
    #: True when the problem is a failure (driver present but broken), not an absence
    failed: bool = False


def take_inventory() -> Inventory:
    """Read the backend once; a missing or broken driver is recorded, not raised."""
    from devicekit.hardware.inventory import backend

    try:
        source = backend()
        gpus = tuple(source.snapshot())
    except DeviceKitError as exc:
        name = "simulated" if os.environ.get("DEVICEKIT_SIMULATE") else "nvml"
        return Inventory(backend=name, gpus=(), problem=str(exc), failed=True)

    def optional(attr: str) -> str | None:
        fn = getattr(source, attr, None)
        try:
            return fn() if callable(fn) else None
        except DeviceKitError:
            return None

    return Inventory(
        backend=source.name,
        gpus=gpus,
        driver_version=source.driver_version(),
        cuda_driver_version=optional("cuda_driver_version"),
        nvml_version=optional("nvml_version"),
        problem=getattr(source, "reason", None),
    )
