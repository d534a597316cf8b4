"""One line for this process's devices: torch's allocator figures plus the driver's view.

Meant to be called every step while hunting where memory goes: for each CUDA device this
process uses (it has a CUDA context there), allocated / reserved / peak from torch's caching
allocator and used / total of the whole GPU from NVML (other processes count there). Without
CUDA in use, the CPU: this process's resident memory, its peak and the machine's available RAM.

Usage::

    import devicekit as dk

    for step, batch in enumerate(loader):
        ...
        dk.show_utilization(this_process=True, label=f"step {step}")
    # step 3: cuda:0 (GPU 2) alloc 1.2 GiB, reserved 2 GiB, peak 1.5 GiB, GPU 10 GiB / 80 GiB used
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from devicekit.units import format_size

if TYPE_CHECKING:
    from devicekit.hardware.gpu import GPU
    from devicekit.memory.usage import DeviceMemory

__all__ = ["process_line", "format_process_line"]


def _size(value: int | None) -> str:
    return "n/a" if value is None else format_size(value)


def _cuda_part(row: DeviceMemory, gpu: GPU | None) -> str:
    where = f"{row.device} (GPU {gpu.index})" if gpu is not None else row.device
    text = (f"{where} alloc {_size(row.allocated)}, reserved {_size(row.reserved)}, "
            f"peak {_size(row.peak)}")
    if gpu is not None:
        text += f", GPU {format_size(gpu.memory_used)} / {format_size(gpu.memory_total)} used"
    elif row.free is not None and row.total is not None:
        text += f", GPU {format_size(row.total - row.free)} / {format_size(row.total)} used"
    return text


def _cpu_part(row: DeviceMemory) -> str:
    text = f"cpu rss {_size(row.process_rss)}, peak {_size(row.peak)}"
    if row.free is not None and row.total is not None:
        text += f", RAM {format_size(row.total - row.free)} / {format_size(row.total)} used"
    return text


def format_process_line(rows: list[tuple[DeviceMemory, GPU | None]], label: str | None = None) -> str:
    """The line for ``rows``: (usage, the physical GPU it is on or None); CPU rows as such."""
    parts = [_cuda_part(row, gpu) if row.device.startswith("cuda") else _cpu_part(row)
             for row, gpu in rows]
    return (f"{label}: " if label else "") + "; ".join(parts)


def process_line(label: str | None = None) -> str:
    """The line for this process now (imports torch)."""
    import torch

    from devicekit.memory.usage import cpu_usage, cuda_usage

    rows: list[tuple[DeviceMemory, GPU | None]] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        physical = _physical_gpus()
        current = torch.cuda.current_device()
        for index in range(torch.cuda.device_count()):
            if index != current and torch.cuda.memory_reserved(index) == 0:
                continue  # no memory of ours there
            uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
            rows.append((cuda_usage(index), physical.get(uuid.removeprefix("GPU-"))))
    if not rows:
        rows.append((cpu_usage(count_tensors=False), None))
    return format_process_line(rows, label)


def _physical_gpus() -> dict[str, GPU]:
    """NVML's GPUs by UUID (without the ``GPU-`` prefix); empty where NVML cannot be read."""
    try:
        from devicekit.hardware.inventory import gpus

        return {gpu.uuid.removeprefix("GPU-"): gpu for gpu in gpus()}
    except Exception:  # NVML trouble must not break a usage line
        return {}
