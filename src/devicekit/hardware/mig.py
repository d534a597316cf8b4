"""MIG instances as devices to select and lease, each with its own memory.

A GPU in MIG mode cannot run CUDA work as a whole: its instances can, each named in
``CUDA_VISIBLE_DEVICES`` by its ``MIG-`` UUID. :func:`leasable_devices` turns the physical GPUs
into what selection chooses among: every GPU not in MIG mode, and one :class:`GPU` snapshot per
MIG instance (``is_mig``, ``parent_uuid``, ``mig_index``, the instance's UUID and memory, the
parent's index). A GPU in MIG mode *without* instances stays, so selection can say why it
cannot be used. CUDA gives one process one MIG instance (older drivers enumerate only the first
one listed), so devicekit hands out a MIG instance only to a request for one device.

Usage::

    import devicekit as dk
    from devicekit.hardware.mig import leasable_devices

    for dev in leasable_devices(dk.gpus()):
        print(dev.label, dev.uuid, dev.memory_free)    # GPU 2 MIG 0 MIG-5d9b... 9.8 GiB
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from devicekit.hardware.gpu import GPU, MigDevice

__all__ = ["instance_device", "leasable_devices", "visible_uuids"]


def instance_device(parent: GPU, mig: MigDevice) -> GPU:
    """The MIG instance ``mig`` of ``parent`` as a device of its own (memory its own, the rest
    the parent's; utilization, power and processes are per card in NVML, so left unknown)."""
    return GPU(
        index=parent.index,
        uuid=mig.uuid,
        name=f"{parent.name} MIG {mig.name}",
        memory_total=mig.memory_total,
        memory_used=mig.memory_used,
        memory_free=mig.memory_free,
        pci_bus_id=parent.pci_bus_id,
        temperature=parent.temperature,
        compute_capability=parent.compute_capability,
        compute_mode=parent.compute_mode,
        architecture=parent.architecture,
        max_sm_clock=parent.max_sm_clock,
        backend=parent.backend,
        parent_uuid=parent.uuid,
        mig_index=mig.index,
    )


def leasable_devices(gpus: Sequence[GPU]) -> list[GPU]:
    """The devices selection chooses among, in NVML order: whole GPUs and MIG instances."""
    out: list[GPU] = []
    for gpu in gpus:
        if gpu.mig_enabled and gpu.mig_devices:
            out.extend(instance_device(gpu, mig) for mig in gpu.mig_devices)
        else:
            out.append(gpu)
    return out


def visible_uuids(gpus: Sequence[GPU], env: Mapping[str, str] | None = None) -> set[str]:
    """UUIDs of the devices (GPUs and MIG instances) this process's CUDA may use.

    With ``CUDA_VISIBLE_DEVICES`` unset every device counts; set, only what it names (a MIG
    instance only by its ``MIG-`` UUID). Raises like :func:`~devicekit.hardware.visible.visible_devices`.
    """
    from devicekit.hardware.visible import VISIBLE_ENV, visible_devices

    env = os.environ if env is None else env
    devices = visible_devices(gpus, env)
    if env.get(VISIBLE_ENV) is None:
        return {g.uuid for g in gpus} | {m.uuid for g in gpus for m in g.mig_devices}
    return {d.uuid for d in devices}
