"""How much memory each device uses right now, measured where it can be and marked where not.

On CUDA the numbers come from the caching allocator (allocated, reserved, peak) and from the
driver (free and total, so other processes count). On CPU there is no caching allocator:
devicekit reports the process's resident memory (RSS), its peak, the bytes of live tensors
(a garbage-collector walk) and the machine's available memory, and sets every figure it cannot
measure to ``None`` with a note saying why. It never reports a zero that is not a measurement.

Usage::

    import devicekit as dk

    for dev in dk.memory.usage():
        print(dev.device, dev.allocated, dev.reserved_unused, dev.free, dev.notes)
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from devicekit.memory.tensors import live_tensors, total_bytes

__all__ = ["DeviceMemory", "usage", "cuda_usage", "cpu_usage", "peak_rss"]


@dataclass(frozen=True)
class DeviceMemory:
    """Memory of one device at one instant; bytes, ``None`` where not measurable (see ``notes``).

    ``allocated``: bytes in live tensors (CUDA: allocator-allocated; CPU: live tensor storages).
    ``reserved``: bytes the caching allocator holds from the driver (CUDA only).
    ``peak``: the highest ``allocated`` since start or ``reset_peak`` (CPU: peak RSS instead).
    ``reserved_unused``: reserved but not allocated: fragmentation or cache, returned by
    ``empty_cache()``. ``free``/``total``: from the driver (CPU: available/total RAM).
    """

    device: str
    name: str | None
    allocated: int | None
    reserved: int | None
    peak: int | None
    reserved_unused: int | None
    free: int | None
    total: int | None
    #: resident memory of this process (CPU row only)
    process_rss: int | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["notes"] = list(self.notes)
        return data


def usage(device: str | int | torch.device | None = None) -> list[DeviceMemory]:
    """One :class:`DeviceMemory` per device: every visible CUDA device, then the CPU.

    ``device`` restricts the answer to one device (``"cuda:1"``, ``1``, ``"cpu"``).
    """
    if device is not None:
        dev = _as_device(device)
        if dev.type == "cuda":
            return [cuda_usage(dev.index if dev.index is not None else torch.cuda.current_device())]
        if dev.type == "cpu":
            return [cpu_usage()]
        if dev.type == "mps":
            return [_mps_usage()]
        from devicekit.errors import InvalidDeviceError

        raise InvalidDeviceError(f"device {device!r} has no memory statistics; use 'cuda:N' or 'cpu'")
    rows = [cuda_usage(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    if _mps_available():
        rows.append(_mps_usage())
    rows.append(cpu_usage())
    return rows


def _as_device(device: str | int | torch.device) -> torch.device:
    from devicekit.errors import InvalidDeviceError

    if isinstance(device, int):
        device = f"cuda:{device}"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidDeviceError(f"device {device!r} is not a device; write e.g. 'cuda:0' or 'cpu'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidDeviceError(f"device {device!r} asked but CUDA is not available; use 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InvalidDeviceError(
                f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s) visible"
            )
    return dev


def cuda_usage(index: int) -> DeviceMemory:
    """Usage of ``cuda:index``; the driver is asked only where this process already has a context."""
    notes: list[str] = []
    props = torch.cuda.get_device_properties(index)
    allocated = torch.cuda.memory_allocated(index)
    reserved = torch.cuda.memory_reserved(index)
    peak = torch.cuda.max_memory_allocated(index)
    free: int | None
    total: int | None = props.total_memory
    if torch.cuda.is_initialized() and (reserved > 0 or index == torch.cuda.current_device()):
        free, total = torch.cuda.mem_get_info(index)
    else:
        free = _nvml_free(props)
        if free is None:
            notes.append(
                "free not measured: this process has no CUDA context on the device and creating "
                "one would cost hundreds of MiB"
            )
    return DeviceMemory(
        device=f"cuda:{index}", name=props.name, allocated=allocated, reserved=reserved, peak=peak,
        reserved_unused=reserved - allocated, free=free, total=total, notes=tuple(notes),
    )


def _nvml_free(props: Any) -> int | None:
    """Free bytes from NVML for the GPU with the same UUID, without creating a CUDA context."""
    uuid = str(getattr(props, "uuid", "") or "")
    if not uuid:
        return None
    try:
        from devicekit.hardware.inventory import gpus

        for gpu in gpus():
            if gpu.uuid.removeprefix("GPU-") == uuid.removeprefix("GPU-"):
                return gpu.memory_free
    except Exception:  # NVML trouble must not break a usage report
        return None
    return None


def cpu_usage(*, count_tensors: bool = True) -> DeviceMemory:
    """The CPU row: live tensor bytes, process RSS and peak RSS, available and total RAM."""
    import psutil

    notes = ["reserved: not applicable, the CPU allocator keeps no cache of its own"]
    allocated: int | None = None
    if count_tensors:
        allocated = total_bytes(t for t in live_tensors() if t.device.type == "cpu")
        notes.append("allocated: bytes of live CPU tensors seen by the garbage collector")
    else:
        notes.append("allocated: not measured (count_tensors=False)")
    rss = psutil.Process(os.getpid()).memory_info().rss
    peak = peak_rss()
    if peak is not None:
        # the kernel updates the high-water mark lazily (ru_maxrss can trail the RSS read just
        # before it by a page-table sync): a peak is never below the current value
        peak = max(peak, rss)
    if peak is None:
        notes.append("peak: not measured, this platform does not report peak RSS")
    else:
        notes.append("peak: peak resident memory of the whole process, not of tensors alone")
    vm = psutil.virtual_memory()
    return DeviceMemory(
        device="cpu", name="host memory", allocated=allocated, reserved=None, peak=peak,
        reserved_unused=None, free=vm.available, total=vm.total, process_rss=rss, notes=tuple(notes),
    )


def peak_rss() -> int | None:
    """This process's peak resident memory in bytes (the kernel's high-water mark); None where
    the platform does not report it."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend and backend.is_available())


def _mps_usage() -> DeviceMemory:
    allocated = torch.mps.current_allocated_memory()
    driver = torch.mps.driver_allocated_memory()
    return DeviceMemory(
        device="mps", name="Apple GPU", allocated=allocated, reserved=driver, peak=None,
        reserved_unused=max(driver - allocated, 0), free=None, total=None,
        notes=("peak, free, total: not reported by the MPS backend",),
    )
