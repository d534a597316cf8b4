"""Naming devices: the best device there is, every accelerator, and checked device specs.

``try_gpu``/``try_all_gpus`` are the seeds' helpers done right: ``cuda:i`` when that GPU exists,
else the machine's accelerator (MPS on a Mac) where it has one, else the CPU. ``as_device``
turns whatever a user wrote (``"cuda:1"``, ``1``, ``torch.device("cpu")``) into a
``torch.device`` that exists, or raises a one-line :class:`~devicekit.errors.InvalidDeviceError`.

Usage::

    import devicekit as dk

    device = dk.try_gpu()            # cuda:0, or mps, or cpu
    devices = dk.try_all_gpus()      # [cuda:0, cuda:1, ...] or [cpu]
    dk.as_device("cuda:1")           # torch.device('cuda', 1), checked to exist
    dk.as_device("gpu:0")            # InvalidDeviceError: unknown device 'gpu:0'; did you mean 'cuda:0'?
"""

from __future__ import annotations

import os
import re

import torch

from devicekit.errors import InvalidDeviceError

__all__ = ["try_gpu", "try_all_gpus", "as_device", "parse_device_spec", "accelerator_type", "DeviceLike"]

DeviceLike = str | int | torch.device  # what as_device accepts

_ALIASES = {"gpu": "cuda", "nvidia": "cuda", "cuda0": "cuda:0", "metal": "mps", "apple": "mps"}
_KNOWN_GOOD: dict[object, torch.device] = {}  # validated specs that carry an explicit index


def accelerator_type() -> str | None:
    """The type of this machine's accelerator (``"cuda"``, ``"mps"``, ``"xpu"``...) or None."""
    current = getattr(getattr(torch, "accelerator", None), "current_accelerator", None)
    if current is not None:  # torch >= 2.6
        found = current()
        return None if found is None else found.type
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return None


def _count(device_type: str) -> int:
    """How many devices of ``device_type`` this process sees (0 when none)."""
    if device_type == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_type == "mps":
        mps = getattr(torch.backends, "mps", None)
        return 1 if mps is not None and mps.is_available() else 0
    if accelerator_type() == device_type:
        return int(torch.accelerator.device_count())
    module = getattr(torch, device_type, None)
    counter = getattr(module, "device_count", None)
    return int(counter()) if callable(counter) else 0


def try_gpu(i: int = 0) -> torch.device:
    """``cuda:i`` if that GPU exists, else the accelerator's device ``i``, else ``cpu``."""
    if isinstance(i, bool) or not isinstance(i, int) or i < 0:
        raise InvalidDeviceError(f"GPU index {i!r} is not a non-negative integer; pass 0, 1, ...")
    kind = accelerator_type()
    if kind is not None and i < _count(kind):
        return torch.device(kind, i)
    return torch.device("cpu")


def try_all_gpus() -> list[torch.device]:
    """Every accelerator device this process sees, or ``[cpu]`` when there is none."""
    kind = accelerator_type()
    if kind is None:
        return [torch.device("cpu")]
    found = [torch.device(kind, i) for i in range(_count(kind))]
    return found or [torch.device("cpu")]


def _visible_note() -> str:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES is unset" if value is None else f"CUDA_VISIBLE_DEVICES={value!r}"


def no_cuda_reason() -> str:
    """Why this process sees no CUDA device, naming the real cause (the build before the variable)."""
    if getattr(torch.version, "cuda", None) is None:
        return (f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch"
                " (pytorch.org/get-started)")
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None and value.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={value!r} hides every GPU"
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU"
            f" ({_visible_note()}); run 'devicekit doctor'")


def _suggest(text: str) -> str:
    """A corrected spelling for a device string torch does not know, or ''."""
    match = re.fullmatch(r"\s*([A-Za-z_]+)\s*(?::\s*(\d+))?\s*", text)
    if not match:
        return ""
    kind, index = match.group(1).lower(), match.group(2)
    fixed = _ALIASES.get(kind, kind if kind in ("cpu", "cuda", "mps", "xpu", "meta") else "")
    if not fixed:
        return ""
    if ":" in fixed or index is None:
        return fixed if fixed != text else ""
    return f"{fixed}:{index}"


def parse_device_spec(spec: object) -> torch.device:
    """``spec`` as a ``torch.device`` without checking that it exists (for planning ahead)."""
    if isinstance(spec, torch.device):
        return spec
    if isinstance(spec, bool):
        raise InvalidDeviceError(f"device {spec!r} is not a device; pass 'cpu', 'cuda:0' or an index")
    if isinstance(spec, int):
        if spec < 0:
            raise InvalidDeviceError(f"device index {spec} is negative; pass 0, 1, ... or 'cpu'")
        return torch.device(accelerator_type() or "cuda", spec)
    if isinstance(spec, str):
        try:
            return torch.device(spec.strip())
        except (RuntimeError, ValueError):
            hint = _suggest(spec)
            advice = f"did you mean {hint!r}?" if hint else "use e.g. 'cpu', 'cuda', 'cuda:0' or 'mps'"
            raise InvalidDeviceError(f"unknown device {spec!r}; {advice}") from None
    raise InvalidDeviceError(
        f"device {spec!r} of type {type(spec).__name__} is not a device; "
        "pass a string such as 'cuda:0', an index or a torch.device"
    )


def as_device(spec: DeviceLike) -> torch.device:
    """A checked ``torch.device`` for ``spec``; index-less accelerators get the current index.

    ``cpu`` and ``meta`` always exist. ``cuda:7`` on a machine with fewer GPUs raises
    :class:`InvalidDeviceError` saying how many exist and what ``CUDA_VISIBLE_DEVICES`` is.
    """
    key = (type(spec), spec)
    try:
        known = _KNOWN_GOOD.get(key)
    except TypeError:  # unhashable spec: validated below, then rejected
        known = None
    if known is not None:
        return known
    device = parse_device_spec(spec)
    kind = device.type
    shown = str(spec) if isinstance(spec, torch.device) else spec  # 'cuda:5', not device(...)
    if kind in ("cpu", "meta"):
        return device
    count = _count(kind)
    if count == 0:
        extra = f": {no_cuda_reason()}" if kind == "cuda" else ""
        raise InvalidDeviceError(
            f"device {shown!r} asked for but this process sees no {kind} device{extra}; "
            "use devicekit.try_gpu() to fall back to the CPU"
        )
    if device.index is None:
        current = torch.cuda.current_device() if kind == "cuda" else 0
        return torch.device(kind, current)
    if device.index >= count:
        extra = f"; {_visible_note()}" if kind == "cuda" else ""
        raise InvalidDeviceError(
            f"device {shown!r} does not exist: this process sees {count} {kind} device(s) "
            f"({kind}:0..{kind}:{count - 1}){extra}"
        )
    if len(_KNOWN_GOOD) < 256:
        _KNOWN_GOOD[key] = device
    return device
