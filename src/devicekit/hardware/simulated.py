"""Simulated GPUs from a JSON file, for CI machines and rehearsing cluster scripts on a laptop.

Point ``DEVICEKIT_SIMULATE`` (or ``devicekit --simulate PATH``) at a file such as::

    {"gpus": [
      {"name": "NVIDIA H100 80GB HBM3", "memory_total": "80GiB", "memory_used": "2GiB",
       "utilization": 5,
       "processes": [{"pid": 4242, "user": "alice", "memory": "2GiB", "command": "python train.py"}]},
      {"name": "NVIDIA H100 80GB HBM3", "memory_total": "80GiB", "memory_used": "0GiB", "utilization": 0}
    ]}

Optional per-GPU keys: ``uuid``, ``pci_bus_id``, ``temperature``, ``power_draw``, ``power_limit``,
``compute_capability`` (``"9.0"`` or ``[9, 0]``), ``compute_mode``, ``memory_bandwidth_utilization``
``mig`` (``true``, or a list of ``{"name", "memory_total", "memory_used", "uuid"}``) and the speed
facts ``architecture``, ``sm_count``, ``max_sm_clock`` (MHz) and ``memory_bandwidth`` (GB/s); speed
facts and ``compute_capability`` left out are filled from the known-model table by name
(:mod:`devicekit.hardware.known_gpus`), so ``{"name": "Tesla T4", ...}`` is a T4. Unknown
keys are errors, so a typo never passes silently. The file is re-read on every snapshot, so a
test or a rehearsal can change it while a job waits.

Usage::

    from devicekit.hardware.simulated import SimulatedBackend

    gpus = SimulatedBackend("cluster.json").snapshot()
"""

from __future__ import annotations

import math
import uuid as uuid_module
from pathlib import Path
from typing import Any

from devicekit.errors import InvalidSizeError, SimulationFileError
from devicekit.hardware.bounded_read import BadFile, read_json
from devicekit.hardware.gpu import GPU, GPUProcess, MigDevice
from devicekit.hardware.known_gpus import lookup
from devicekit.hardware.printable import printable
from devicekit.units import parse_size

__all__ = ["SimulatedBackend", "load_simulation"]

_GPU_KEYS = {
    "name", "memory_total", "memory_used", "utilization", "processes", "uuid", "pci_bus_id",
    "temperature", "power_draw", "power_limit", "compute_capability", "compute_mode", "mig",
    "memory_bandwidth_utilization", "architecture", "sm_count", "max_sm_clock", "memory_bandwidth",
}
#: the largest simulation file read (a real one is a few KiB)
MAX_SIMULATION_BYTES = 4 * 1024 * 1024
#: the largest memory size a simulated GPU may have (1 PiB)
MAX_SIMULATED_SIZE = 1 << 50
_PROC_KEYS = {"pid", "user", "memory", "command"}
_MIG_KEYS = {"name", "memory_total", "memory_used", "uuid"}
_NAMESPACE = uuid_module.UUID("6d3c1f0e-8b1a-4d59-9f6e-2b7c0a5e4d21")


class SimulatedBackend:
    """Reads GPUs from a simulation file; same facts as NVML gives, from JSON."""

    name = "simulated"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def snapshot(self) -> list[GPU]:
        return load_simulation(self.path)

    def driver_version(self) -> str | None:
        return "simulated"


def load_simulation(path: str | Path) -> list[GPU]:
    """Parse the simulation file into GPU snapshots; raise :class:`SimulationFileError` if bad."""
    path = Path(path)
    try:  # bounded, never blocking, and a file rewritten in place is re-read, not fatal
        data = read_json(path, MAX_SIMULATION_BYTES, settle=True)
    except BadFile as exc:
        hint = "; check DEVICEKIT_SIMULATE / --simulate" if "cannot be read" in exc.problem else ""
        raise SimulationFileError(f"simulation file {printable(exc)}{hint}") from None
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list):
        raise SimulationFileError(
            f"simulation file {str(path)!r} must be an object with a 'gpus' list"
        )
    extra_top = set(data) - {"gpus"}
    if extra_top:
        raise SimulationFileError(
            f"simulation file {str(path)!r}: unknown key {sorted(extra_top)[0]!r} (only 'gpus')"
        )
    found = [_parse_gpu(path, i, entry) for i, entry in enumerate(data["gpus"])]
    seen: dict[str, int] = {}
    for gpu in found:  # leases and CUDA_VISIBLE_DEVICES name GPUs by UUID: they must differ
        for uuid in (gpu.uuid, *(m.uuid for m in gpu.mig_devices)):
            if uuid.lower() in seen:
                raise _fail(path, f"gpus[{gpu.index}].uuid",
                            f"{uuid!r} repeats the UUID of gpus[{seen[uuid.lower()]}]")
            seen[uuid.lower()] = gpu.index
    return found


def _fail(path: Path, where: str, message: str) -> SimulationFileError:
    return SimulationFileError(f"simulation file {str(path)!r}: {where}: {message}")


def _size(path: Path, where: str, value: Any) -> int:
    try:
        size = parse_size(value, name=where, bare=False)
    except InvalidSizeError as exc:  # "gpus[0].memory_total 80 has no unit": name the key once
        raise _fail(path, where, str(exc).removeprefix(f"{where} ")) from None
    if size > MAX_SIMULATED_SIZE:
        raise _fail(path, where, f"{value!r} is more than {MAX_SIMULATED_SIZE >> 50} PiB, "
                                 "which no GPU has")
    return size


def _number(path: Path, where: str, value: Any, *, low: float | None = None,
            high: float | None = None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(path, where, f"{value!r} is not a number")
    if (low is not None and value < low) or (high is not None and value > high):
        raise _fail(path, where, f"{value!r} is outside {low}..{high}")
    return float(value)


def _parse_gpu(path: Path, index: int, entry: Any) -> GPU:
    where = f"gpus[{index}]"
    if not isinstance(entry, dict):
        raise _fail(path, where, "each GPU must be an object")
    unknown = set(entry) - _GPU_KEYS
    if unknown:
        raise _fail(path, where, f"unknown key {sorted(unknown)[0]!r}")
    for key in ("name", "memory_total"):
        if key not in entry:
            raise _fail(path, where, f"missing key {key!r}")
    name = entry["name"]
    if not isinstance(name, str) or not name:
        raise _fail(path, f"{where}.name", f"{name!r} is not a name")
    total = _size(path, f"{where}.memory_total", entry["memory_total"])
    if total <= 0:
        raise _fail(path, f"{where}.memory_total", f"{entry['memory_total']!r} is no memory at all")
    used = _size(path, f"{where}.memory_used", entry.get("memory_used", "0GiB"))
    if used > total:
        raise _fail(path, f"{where}.memory_used", "is larger than memory_total")
    processes = tuple(_parse_process(path, f"{where}.processes[{j}]", p)
                      for j, p in enumerate(_list(path, f"{where}.processes",
                                                  entry.get("processes", []))))
    uuid = entry.get("uuid") or f"GPU-{uuid_module.uuid5(_NAMESPACE, f'{index}/{name}')}"
    if not isinstance(uuid, str):
        raise _fail(path, f"{where}.uuid", f"{uuid!r} is not a string")
    pci = entry.get("pci_bus_id") or f"00000000:{0x10 + index:02X}:00.0"
    temp = _number(path, f"{where}.temperature", entry.get("temperature"), low=-50, high=150)
    util = _number(path, f"{where}.utilization", entry.get("utilization", 0), low=0, high=100)
    bw = _number(path, f"{where}.memory_bandwidth_utilization",
                 entry.get("memory_bandwidth_utilization"), low=0, high=100)
    mig_enabled, mig_devices = _parse_mig(path, f"{where}.mig", entry.get("mig"), uuid)
    known = lookup(name)
    cc = _parse_cc(path, f"{where}.compute_capability", entry.get("compute_capability"))
    architecture = entry.get("architecture", known.architecture if known else None)
    if architecture is not None and not isinstance(architecture, str):
        raise _fail(path, f"{where}.architecture", f"{architecture!r} is not a string")
    sm_count = _number(path, f"{where}.sm_count", entry.get("sm_count"), low=1)
    clock = _number(path, f"{where}.max_sm_clock", entry.get("max_sm_clock"), low=1)
    bandwidth = _number(path, f"{where}.memory_bandwidth", entry.get("memory_bandwidth"), low=0)
    return GPU(
        index=index,
        uuid=uuid,
        name=name,
        memory_total=total,
        memory_used=used,
        memory_free=total - used,
        pci_bus_id=str(pci),
        utilization=util,
        memory_bandwidth_utilization=bw,
        temperature=int(temp) if temp is not None else None,
        power_draw=_number(path, f"{where}.power_draw", entry.get("power_draw"), low=0),
        power_limit=_number(path, f"{where}.power_limit", entry.get("power_limit"), low=0),
        compute_capability=cc if cc is not None else (known.compute_capability if known else None),
        compute_mode=_parse_mode(path, f"{where}.compute_mode", entry.get("compute_mode")),
        mig_enabled=mig_enabled,
        mig_devices=mig_devices,
        processes=processes,
        architecture=architecture,
        sm_count=int(sm_count) if sm_count is not None else (known.sm_count if known else None),
        max_sm_clock=int(clock) if clock is not None else (known.max_sm_clock if known else None),
        memory_bandwidth=bandwidth if bandwidth is not None else (
            known.memory_bandwidth_gbs if known else None),
        backend="simulated",
    )


def _list(path: Path, where: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(path, where, "must be a list")
    return value


def _parse_process(path: Path, where: str, entry: Any) -> GPUProcess:
    if not isinstance(entry, dict):
        raise _fail(path, where, "each process must be an object")
    unknown = set(entry) - _PROC_KEYS
    if unknown:
        raise _fail(path, where, f"unknown key {sorted(unknown)[0]!r}")
    pid = entry.get("pid")
    if pid is None:
        raise _fail(path, f"{where}.pid", "is missing; every process needs its pid (a positive integer)")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise _fail(path, f"{where}.pid", f"{pid!r} is not a process id")
    for key in ("user", "command"):
        if entry.get(key) is not None and not isinstance(entry[key], str):
            raise _fail(path, f"{where}.{key}", f"{entry[key]!r} is not a string")
    memory = entry.get("memory")
    return GPUProcess(
        pid=pid,
        user=entry.get("user"),
        command=entry.get("command"),
        memory=_size(path, f"{where}.memory", memory) if memory is not None else None,
    )


def _parse_cc(path: Path, where: str, value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        if isinstance(value, str):
            major, minor = value.split(".")
            return int(major), int(minor)
        if isinstance(value, (list, tuple)) and len(value) == 2:
            return int(value[0]), int(value[1])
    except (ValueError, TypeError, OverflowError):
        pass
    raise _fail(path, where, f"{value!r} is not a compute capability like '9.0'")


def _parse_mode(path: Path, where: str, value: Any) -> str | None:
    modes = {"default", "exclusive_process", "prohibited"}
    if value is None:
        return "default"
    if value not in modes:
        raise _fail(path, where, f"{value!r} is not one of {sorted(modes)}")
    return str(value)


def _parse_mig(path: Path, where: str, value: Any, parent_uuid: str
               ) -> tuple[bool, tuple[MigDevice, ...]]:
    if value is None or value is False:
        return False, ()
    if value is True:
        return True, ()
    devices = []
    for k, item in enumerate(_list(path, where, value)):
        spot = f"{where}[{k}]"
        if not isinstance(item, dict):
            raise _fail(path, spot, "each MIG instance must be an object")
        unknown = set(item) - _MIG_KEYS
        if unknown:
            raise _fail(path, spot, f"unknown key {sorted(unknown)[0]!r}")
        if "memory_total" not in item:
            raise _fail(path, spot, "missing key 'memory_total'")
        mig_uuid = item.get("uuid") or f"MIG-{uuid_module.uuid5(_NAMESPACE, f'{parent_uuid}/{k}')}"
        total = _size(path, f"{spot}.memory_total", item["memory_total"])
        used = _size(path, f"{spot}.memory_used", item.get("memory_used", "0GiB"))
        if used > total:
            raise _fail(path, f"{spot}.memory_used", "is larger than memory_total")
        devices.append(MigDevice(
            index=k,
            uuid=str(mig_uuid),
            name=str(item.get("name", f"MIG {k}")),
            memory_total=total,
            memory_used=used,
        ))
    return True, tuple(devices)
