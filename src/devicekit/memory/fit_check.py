"""Does an estimated step fit a budget or a GPU? A yes/no with the reason, in one line.

A size ("24GiB", bytes) is compared with the step's peak (on a CUDA estimate: with the high
end of what nvidia-smi will show). A GPU (``dk.GPU``, simulated or NVML) is compared with its
free memory, using the range of :mod:`devicekit.memory.gpu_overhead` (allocator reserve, CUDA
context, cuBLAS/cuDNN workspaces) on top of the tensors' peak, whatever device the estimate
was sized on.

Usage::

    fit = est.fits("24GiB")
    if not fit:
        print(fit.reason)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from devicekit.errors import InvalidValueError
from devicekit.memory.gpu_overhead import gpu_range
from devicekit.units import format_size, parse_size

__all__ = ["Fit", "check_fit"]

_HOPPER = ("H100", "H200", "GH200", "H800", "H20")


@dataclass(frozen=True)
class Fit:
    """``bool(fit)`` says whether it fits; ``reason`` says why, with the numbers."""

    ok: bool
    reason: str
    needed: int
    available: int

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        return self.reason


def check_fit(peak: int, low: int, high: int, device_type: str, target: Any, *,
              convolutions: bool) -> Fit:
    """Whether a step (``peak`` allocated; ``low``..``high`` as nvidia-smi shows) fits ``target``."""
    if hasattr(target, "memory_free") and hasattr(target, "memory_total"):
        name = str(getattr(target, "name", "GPU"))
        label = f"gpu{getattr(target, 'index', '')} ({name})"
        free = int(target.memory_free)
        low, expected, high = gpu_range(peak, convolutions=convolutions,
                                        hopper=any(h in name for h in _HOPPER),
                                        workspaces_counted=device_type == "cuda")
        util = getattr(target, "utilization", None)
        load = f"; it is {util:.0f} % busy" if isinstance(util, (int, float)) and util >= 50 else ""
        if high <= free:
            return Fit(True, f"fits {label}: needs {format_size(low)}-{format_size(high)} as nvidia-smi "
                       f"shows it, {format_size(free)} free{load}", high, free)
        if expected <= free:
            return Fit(True, f"fits {label} tightly: needs about {format_size(expected)} (up to "
                       f"{format_size(high)}), {format_size(free)} free{load}", expected, free)
        return Fit(False, f"does not fit {label}: needs about {format_size(expected)} (at least "
                   f"{format_size(low)}), only {format_size(free)} free{load}", expected, free)
    if isinstance(target, bool) or not isinstance(target, (int, str)):
        raise InvalidValueError(f"fits({target!r}): give a size such as '24GiB' or a dk.GPU")
    budget = parse_size(target, name="budget")
    need = high if device_type == "cuda" else peak
    what = "the high end of what nvidia-smi shows" if device_type == "cuda" else "bytes allocated at the peak"
    if need <= budget:
        return Fit(True, f"fits {format_size(budget)}: needs {format_size(need)} ({what})", need, budget)
    return Fit(False, f"does not fit {format_size(budget)}: needs {format_size(need)} ({what})", need, budget)
