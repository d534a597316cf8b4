"""Does an estimated step fit a budget or a GPU? A yes/no with the reason, in one line.

A size ("24GiB", bytes) is compared with the step's peak (on a CUDA estimate: with the high
end of what nvidia-smi will show). A GPU (``dk.GPU``, simulated or NVML) is compared with its
free memory, using the range of :mod:`devicekit.memory.gpu_overhead` (allocator reserve, CUDA
context, cuBLAS/cuDNN workspaces) on top of the tensors' peak, whatever device the estimate
was sized on: a step sized on the CPU has no cuBLAS workspaces in its peak, so both are added,
and the answer says so. One rule (:func:`gpu_need`, also used by ``dk.advise``): the high end
within the free memory fits; only the expected figure within it fits tightly (it may not fit);
else it does not fit.

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

__all__ = ["Fit", "GpuNeed", "check_fit", "gpu_need", "is_hopper"]

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


def is_hopper(name: str) -> bool:
    """Whether a GPU of this name is Hopper or newer (32 MiB cuBLAS workspaces)."""
    return any(h in name for h in _HOPPER)


@dataclass(frozen=True)
class GpuNeed:
    """What nvidia-smi will show for a step (``low``..``high``, about ``expected``) against ``free``."""

    low: int
    expected: int
    high: int
    free: int
    device_type: str                   # where the step was sized: "cuda", or "cpu" (workspaces added)

    @property
    def verdict(self) -> str:
        """"fits" (the high end is free), "may not fit" (only the expected figure is) or "does not fit"."""
        if self.high <= self.free:
            return "fits"
        return "may not fit" if self.expected <= self.free else "does not fit"

    @property
    def ok(self) -> bool:
        """Fits, tightly or not: the expected figure is free."""
        return self.expected <= self.free

    def sized(self) -> str:
        """Where the step was sized and what nvidia-smi will show, in words ("" when traced on CUDA)."""
        if self.device_type == "cuda":
            return ""
        where = "the CPU" if self.device_type == "cpu" else self.device_type
        return (f"sized on {where}; on a GPU nvidia-smi will show about {format_size(self.expected)} "
                f"({format_size(self.low)} to {format_size(self.high)}) with the CUDA context and cuBLAS "
                "workspaces")


def gpu_need(peak: int, free: int, *, device_type: str, convolutions: bool, name: str = "") -> GpuNeed:
    """The nvidia-smi range of a step peaking at ``peak`` (sized on ``device_type``) against ``free`` bytes."""
    low, expected, high = gpu_range(peak, convolutions=convolutions, hopper=is_hopper(name),
                                    workspaces_counted=device_type == "cuda")
    return GpuNeed(low, expected, high, int(free), device_type)


def check_fit(peak: int, low: int, high: int, device_type: str, target: Any, *,
              convolutions: bool) -> Fit:
    """Whether a step (``peak`` allocated; ``low``..``high`` as nvidia-smi shows) fits ``target``."""
    if hasattr(target, "memory_free") and hasattr(target, "memory_total"):
        name = str(getattr(target, "name", "GPU"))
        label = f"gpu{getattr(target, 'index', '')} ({name})"
        need = gpu_need(peak, int(target.memory_free), device_type=device_type, convolutions=convolutions,
                        name=name)
        low, expected, high, free = need.low, need.expected, need.high, need.free
        util = getattr(target, "utilization", None)
        load = f"; it is {util:.0f} % busy" if isinstance(util, (int, float)) and util >= 50 else ""
        if need.sized():                      # sized off CUDA: say so, and what nvidia-smi will show
            if need.verdict == "fits":
                return Fit(True, f"fits {label}: {need.sized()}, {format_size(free)} free{load}", high, free)
            if need.verdict == "may not fit":
                return Fit(True, f"fits {label} tightly (it may not fit): {need.sized()}, "
                           f"{format_size(free)} free{load}", expected, free)
            return Fit(False, f"does not fit {label}: {need.sized()}, only {format_size(free)} free{load}",
                       expected, free)
        if need.verdict == "fits":
            return Fit(True, f"fits {label}: needs {format_size(low)}-{format_size(high)} as nvidia-smi "
                       f"shows it, {format_size(free)} free{load}", high, free)
        if need.verdict == "may not fit":
            return Fit(True, f"fits {label} tightly: needs about {format_size(expected)} (up to "
                       f"{format_size(high)}), {format_size(free)} free{load}", expected, free)
        return Fit(False, f"does not fit {label}: needs about {format_size(expected)} (at least "
                   f"{format_size(low)}), only {format_size(free)} free{load}", expected, free)
    if isinstance(target, bool) or not isinstance(target, (int, str)):
        raise InvalidValueError(f"fits({target!r}): give a size such as '24GiB' or a dk.GPU")
    budget = parse_size(target, name="budget")
    need_bytes = high if device_type == "cuda" else peak
    what = "the high end of what nvidia-smi shows" if device_type == "cuda" else "bytes allocated at the peak"
    if need_bytes <= budget:
        return Fit(True, f"fits {format_size(budget)}: needs {format_size(need_bytes)} ({what})", need_bytes,
                   budget)
    return Fit(False, f"does not fit {format_size(budget)}: needs {format_size(need_bytes)} ({what})",
               need_bytes, budget)
