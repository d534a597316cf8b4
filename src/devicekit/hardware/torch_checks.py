"""Doctor checks that need torch: its build against the driver, its release, and NCCL.

torch is imported inside the functions, only when ``devicekit doctor`` runs them (``status`` and
``select`` never import this module). A CPU-only torch on a machine with NVIDIA GPUs is a fail;
a torch built for a newer CUDA major version than the driver supports is a fail; a newer minor
version is a warning (CUDA minor-version compatibility runs most, not all, kernels). A torch
older than :data:`TORCH_FLOOR` is a fail; newer than :data:`TORCH_NEWEST_TESTED`, a warning.

Usage::

    from devicekit.hardware.check_result import take_inventory
    from devicekit.hardware.torch_checks import check_nccl, check_torch_build, check_torch_version

    print(check_torch_build(take_inventory()).message)
    print(check_torch_version().message)     # e.g. "torch 2.13.0+cpu, within the tested ..."
    print(check_nccl().message)
"""

from __future__ import annotations

import os
import re
from typing import Any

from devicekit.hardware.check_result import Check, Inventory

__all__ = [
    "check_torch_build", "check_torch_version", "check_nccl", "parse_cuda_version",
    "parse_torch_version", "format_nccl_version", "TORCH_FLOOR", "TORCH_NEWEST_TESTED",
]

#: The oldest torch release devicekit supports: pyproject.toml's ``torch>=`` (a test checks they
#: agree). Below it FSDP2 cannot shard over gloo (2.6) or averages gradients wrongly (2.7).
TORCH_FLOOR = (2, 8)
#: The newest torch release the whole test suite has passed on (docs/torch-versions.md).
TORCH_NEWEST_TESTED = (2, 15)


def parse_cuda_version(text: str | None) -> tuple[int, int] | None:
    """``"12.4"`` -> ``(12, 4)``; None for missing or unparseable text."""
    if not text:
        return None
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def parse_torch_version(text: str | None) -> tuple[int, int] | None:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; ``"2.16.0.dev20260101"`` -> ``(2, 16)``; None if unreadable."""
    match = re.match(r"\s*(\d+)\.(\d+)", str(text or ""))
    return (int(match.group(1)), int(match.group(2))) if match else None


def _release(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def check_torch_version(version: str | None = None) -> Check:
    """torch's release against the range devicekit supports and was tested on.

    ``version``: torch's ``__version__`` (the installed torch's when None). Below the floor is a
    fail; newer than the newest tested release is a warning; otherwise a pass.
    """
    name = "torch_version"
    if version is None:
        torch, error = _import_torch()
        if torch is None:
            return Check(name, "skip", f"torch cannot be imported ({error})")
        version = str(torch.__version__)
    found = parse_torch_version(version)
    floor, newest = _release(TORCH_FLOOR), _release(TORCH_NEWEST_TESTED)
    if found is None:
        return Check(name, "warn", f"cannot read torch's version {version!r}; devicekit supports "
                     f"torch {floor} to {newest}")
    if found < TORCH_FLOOR:
        return Check(name, "fail", f"torch {version} is older than {floor}, the oldest release "
                     f"devicekit supports; upgrade with pip install 'torch>={floor}'")
    if found > TORCH_NEWEST_TESTED:
        return Check(name, "warn", f"torch {version} is newer than {newest}, the newest release "
                     "devicekit was tested on; it should work, but report what does not")
    return Check(name, "pass", f"torch {version}, within the tested {floor} to {newest}")


def _import_torch() -> tuple[Any | None, str | None]:
    try:
        import torch
    except Exception as exc:  # broken installs raise all sorts (OSError for missing .so files)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, first
    return torch, None


def _wheel_hint(driver_cuda: tuple[int, int] | None) -> str:
    if driver_cuda is None:
        return "install a CUDA build of torch (see pytorch.org/get-started)"
    tag = f"cu{driver_cuda[0]}{driver_cuda[1]}"
    return (f"install a CUDA build no newer than the driver, e.g. 'pip install torch "
            f"--index-url https://download.pytorch.org/whl/{tag}' (or the nearest older cuXY)")


def check_torch_build(inv: Inventory) -> Check:
    """torch's build (CPU, CUDA x.y, ROCm) against the GPUs and the driver's CUDA version."""
    name = "torch"
    torch, error = _import_torch()
    if torch is None:
        return Check(name, "fail", f"torch cannot be imported ({error}); reinstall it")
    version = torch.__version__
    cuda = getattr(torch.version, "cuda", None)
    hip = getattr(torch.version, "hip", None)
    nvidia = list(inv.gpus)
    driver_cuda = parse_cuda_version(inv.cuda_driver_version)
    if hip:
        if nvidia and inv.backend == "nvml":
            return Check(name, "fail", f"torch {version} is a ROCm (HIP {hip}) build but the GPUs "
                         f"are NVIDIA; {_wheel_hint(driver_cuda)}")
        return Check(name, "pass", f"torch {version}, ROCm (HIP {hip}) build")
    if cuda is None:
        if nvidia and inv.backend == "nvml":
            return Check(name, "fail", f"torch {version} is a CPU-only build but {len(nvidia)} "
                         f"NVIDIA GPU(s) are here; {_wheel_hint(driver_cuda)}")
        if nvidia:
            return Check(name, "warn", f"torch {version} is a CPU-only build; fine for these "
                         "simulated GPUs, but it would not use real ones")
        return Check(name, "pass", f"torch {version}, CPU-only build (no GPUs here)")
    built = parse_cuda_version(cuda)
    if inv.backend != "nvml" or not nvidia:
        return Check(name, "pass", f"torch {version}, built for CUDA {cuda} (no NVIDIA GPU to check "
                     "it against)")
    if built and driver_cuda:
        if built[0] > driver_cuda[0]:
            return Check(name, "fail", f"torch {version} is built for CUDA {cuda} but the driver "
                         f"{inv.driver_version} supports CUDA <= {inv.cuda_driver_version}; "
                         f"upgrade the driver or {_wheel_hint(driver_cuda)}")
        if built > driver_cuda:
            return Check(name, "warn", f"torch {version} is built for CUDA {cuda}, newer than the "
                         f"driver's {inv.cuda_driver_version}: minor-version compatibility runs "
                         "most kernels, but upgrade the driver to be safe")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or visible.strip():
        try:
            available = bool(torch.cuda.is_available())
        except Exception as exc:  # a driver/runtime mismatch can raise here
            return Check(name, "fail", f"torch.cuda.is_available() raised ({exc}); check the driver")
        if not available:
            return Check(name, "fail", f"torch {version} (CUDA {cuda}) cannot use the "
                         f"{len(nvidia)} GPU(s) NVML sees (torch.cuda.is_available() is False); "
                         "check CUDA_VISIBLE_DEVICES and the driver")
    return Check(name, "pass", f"torch {version}, built for CUDA {cuda}; driver supports "
                 f"<= {inv.cuda_driver_version or '?'}")


def format_nccl_version(value: Any) -> str:
    """torch.cuda.nccl.version() gives ``(2, 21, 5)`` (or an int like ``2708`` on old torch)."""
    if isinstance(value, tuple):
        return ".".join(str(v) for v in value)
    code = int(value)
    if code >= 10000:  # NCCL >= 2.9: major*10000 + minor*100 + patch
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


#: NCCL_* variables that change nothing in NCCL: NCCL_DEBUG only logs, and NVIDIA's container
#: images set NCCL_VERSION as a label of the NCCL they ship (torch brings its own, often another)
_NOT_SETTINGS = frozenset({"NCCL_DEBUG", "NCCL_VERSION"})


def check_nccl() -> Check:
    """NCCL's version where torch has CUDA; NCCL_* variables that change its behaviour."""
    name = "nccl"
    torch, _ = _import_torch()
    if torch is None or getattr(torch.version, "cuda", None) is None:
        return Check(name, "skip", "no CUDA build of torch, so no NCCL (gloo serves CPU jobs)")
    try:
        import torch.distributed as dist

        has_nccl = dist.is_available() and dist.is_nccl_available()
    except Exception:
        has_nccl = False
    if not has_nccl:
        return Check(name, "warn", f"torch {torch.__version__} has no NCCL backend: multi-GPU "
                     "jobs fall back to gloo, which is much slower")
    try:
        version = format_nccl_version(torch.cuda.nccl.version())
    except Exception as exc:
        return Check(name, "warn", f"NCCL is built in but its version cannot be read ({exc})")
    tuned = sorted(k for k in os.environ if k.startswith("NCCL_") and k not in _NOT_SETTINGS)
    message = f"NCCL {version}"
    if tuned:
        message += "; set: " + ", ".join(f"{k}={os.environ[k]}" for k in tuned)
        if any(k in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_SHM_DISABLE") and
               os.environ[k] not in ("0", "") for k in tuned):
            return Check(name, "warn", message + " (a *_DISABLE variable slows collectives)")
    return Check(name, "pass", message)
