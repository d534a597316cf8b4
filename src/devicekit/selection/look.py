"""One look at the machine for one request: the GPUs, the devices that can be leased, what this
process may see, the live leases, the lease directory and its queue policy, read once.

Every stage of selection reads the same :class:`Look`, so a request sees one moment and the
lease directory is resolved (and checked) once, not by each stage on its own.

Usage::

    from devicekit.selection.look import take_look

    look = take_look()
    print(len(look.devices), [r.describe() for r in look.leases], look.policy.note)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from devicekit.hardware import inventory
from devicekit.hardware.gpu import GPU
from devicekit.hardware.mig import leasable_devices, visible_uuids
from devicekit.hardware.visible import VISIBLE_ENV
from devicekit.sharing.lease_directory import lease_dir
from devicekit.sharing.lease_records import LeaseRecord, read_leases
from devicekit.sharing.policy import Policy, load_policy

__all__ = ["Look", "take_look"]


@dataclass(frozen=True)
class Look:
    """The machine as one request sees it at one moment."""

    #: physical GPUs, NVML order (the inventory snapshot)
    gpus: tuple[GPU, ...]
    #: what can be leased: GPUs and MIG instances
    devices: tuple[GPU, ...]
    #: UUIDs this process may use (CUDA_VISIBLE_DEVICES)
    visible: frozenset[str]
    #: how visibility was decided, for "hidden by ..." reasons
    visible_note: str
    directory: Path
    policy: Policy
    leases: tuple[LeaseRecord, ...]

    def again(self, *, cleanup: bool = False) -> Look:
        """The same GPUs with the leases read afresh (a retry after a lost race)."""
        return replace(self, leases=tuple(read_leases(self.directory, cleanup=cleanup)))

    def no_gpu_reason(self) -> str:
        """Why there is nothing to choose from ("" when there are GPUs)."""
        if self.gpus:
            return ""
        reason = getattr(inventory.backend(), "reason", None)
        return f"no GPUs found ({reason})" if reason else "no GPUs found"


def take_look(gpus: Sequence[GPU] | None = None, *, cleanup: bool = False) -> Look:
    """Read the machine once: ``gpus`` (an inventory snapshot the caller already has, or a new
    one), the lease directory, its policy and live leases (``cleanup``: delete stale files)."""
    snapshot = tuple(inventory.gpus() if gpus is None else gpus)
    directory = lease_dir()
    return Look(snapshot, tuple(leasable_devices(snapshot)), frozenset(visible_uuids(snapshot)),
                f"{VISIBLE_ENV}={os.environ.get(VISIBLE_ENV)!r}", directory,
                load_policy(directory), tuple(read_leases(directory, cleanup=cleanup)))
