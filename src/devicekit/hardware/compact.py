"""One line per GPU: the compact form of the utilization table, for sprinkling through a script.

Where ``GPUtil.showUtilization()`` is called between steps to see where memory goes, the full
table (10-14 lines) buries the script's own output. ``gpu_lines`` gives one line per physical GPU
from NVML (no torch import): index, name, GPU-busy %, memory used / total (percent), processes.

Usage::

    import devicekit as dk

    dk.show_utilization(compact=True)
    # GPU 0 NVIDIA H100 80GB HBM3: 12% busy, 10 GiB / 80 GiB used (12%), 1 process
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from devicekit.units import format_size

if TYPE_CHECKING:
    from devicekit.hardware.gpu import GPU

__all__ = ["gpu_line", "gpu_lines"]


def gpu_line(gpu: GPU) -> str:
    """``GPU 0 NAME: 12% busy, 10 GiB / 80 GiB used (12%), 1 process``."""
    busy = "busy n/a" if gpu.utilization is None else f"{gpu.utilization:.0f}% busy"
    percent = 100 * gpu.memory_used / gpu.memory_total if gpu.memory_total else 0.0
    count = len(gpu.processes)
    return (f"GPU {gpu.index} {gpu.name}: {busy}, {format_size(gpu.memory_used)} / "
            f"{format_size(gpu.memory_total)} used ({percent:.0f}%), "
            f"{count} process{'' if count == 1 else 'es'}")


def gpu_lines(label: str | None = None) -> list[str]:
    """One line per GPU on this machine now (``label: `` in front of each when given); a
    machine without GPUs gives one line saying so."""
    from devicekit.hardware.inventory import backend

    source = backend()
    gpus = source.snapshot()
    prefix = f"{label}: " if label else ""
    if not gpus:
        reason = getattr(source, "reason", None)
        return [f"{prefix}no GPUs" + (f" ({reason})" if reason else "")]
    return [prefix + gpu_line(gpu) for gpu in gpus]
