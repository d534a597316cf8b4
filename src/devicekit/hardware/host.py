"""Facts about the machine itself (cores, memory, load, CPU affinity) via psutil; never sleeps.

``cpu_percent`` is psutil's non-blocking reading: the share of CPU time used since the previous
``host()`` call. It is ``None`` when that was less than 0.1 s ago (the first call of a process,
e.g. a one-shot ``devicekit status``), because so short a window says nothing; in a ``--watch``
loop it is the usage between refreshes. ``load_average`` is the kernel's 1/5/15-minute
run-queue average.
``usable_cpus`` counts the cores this process may run on (its affinity), which is what a
DataLoader's ``num_workers`` should be sized by, not the machine's core count.

Usage::

    import devicekit as dk

    h = dk.host()
    print(h.hostname, h.cpu_count_logical, h.usable_cpus, h.load_average)
    print(f"{h.memory_available / 2**30:.1f} GiB RAM available")
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Host", "host"]

_MIN_CPU_WINDOW = 0.1  # seconds; a shorter cpu_percent window is noise
_last_cpu_reading: list[float] = []  # monotonic time of the previous psutil.cpu_percent call


@dataclass(frozen=True)
class Host:
    """A snapshot of the host: CPU, memory and load. Memory figures are bytes."""

    hostname: str
    cpu_count_logical: int
    cpu_count_physical: int | None
    #: 1, 5 and 15-minute load averages (None where the OS has none)
    load_average: tuple[float, float, float] | None
    #: % of all CPUs busy since the previous reading; None on a first, too-short one (see above)
    cpu_percent: float | None
    memory_total: int
    memory_available: int
    memory_used: int
    #: CPU ids this process may run on (None where the OS cannot say, e.g. macOS)
    cpu_affinity: tuple[int, ...] | None

    @property
    def usable_cpus(self) -> int:
        """Cores this process may use: its affinity if known, else every logical core."""
        return len(self.cpu_affinity) if self.cpu_affinity else self.cpu_count_logical

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the ``host`` object of ``devicekit status --json``)."""
        data = asdict(self)
        data["load_average"] = list(self.load_average) if self.load_average else None
        data["cpu_affinity"] = list(self.cpu_affinity) if self.cpu_affinity is not None else None
        data["usable_cpus"] = self.usable_cpus
        return data


def host() -> Host:
    """Read the host's facts now (a few cheap system calls, no sleeping)."""
    import psutil

    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False)
    try:
        load: tuple[float, float, float] | None = tuple(  # type: ignore[assignment]
            float(x) for x in psutil.getloadavg()
        )
    except (OSError, AttributeError):
        load = None
    percent: float | None
    try:
        now = time.monotonic()
        reading = float(psutil.cpu_percent(interval=None))  # never sleeps; resets the window
        window = now - _last_cpu_reading[-1] if _last_cpu_reading else 0.0
        _last_cpu_reading[:] = [now]
        percent = reading if window >= _MIN_CPU_WINDOW else None
    except (OSError, psutil.Error):
        percent = None
    memory = psutil.virtual_memory()
    affinity: tuple[int, ...] | None
    try:
        affinity = tuple(sorted(psutil.Process().cpu_affinity()))  # type: ignore[attr-defined]
    except (AttributeError, OSError, psutil.Error):  # not offered on this OS
        affinity = None
    return Host(
        hostname=socket.gethostname(),
        cpu_count_logical=int(logical),
        cpu_count_physical=int(physical) if physical else None,
        load_average=load,
        cpu_percent=percent,
        memory_total=int(memory.total),
        memory_available=int(memory.available),
        memory_used=int(memory.used),
        cpu_affinity=affinity,
    )
