"""Which devices ``devicekit bench --device ...`` means: ``cpu``, ``cuda``/``all``, ``cuda:N``, ``N``.

Usage::

    from devicekit.measure.devices import bench_devices

    bench_devices(None)               # the CPU and every visible GPU
    bench_devices(["cpu", "cuda:1"])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from devicekit.errors import InvalidDeviceError

__all__ = ["bench_devices", "cuda_count"]


def cuda_count() -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:  # a broken driver: no GPUs, said in the report's notes
        return 0


def bench_devices(names: Sequence[str] | str | None) -> list[torch.device]:
    """Parse device names; an unknown name or a GPU that does not exist is one-line error."""
    count = cuda_count()
    every_gpu = [torch.device("cuda", i) for i in range(count)]
    if names is None:
        return [torch.device("cpu"), *every_gpu]
    if isinstance(names, str):
        names = [names]
    out: list[torch.device] = []
    for raw in names:
        for name in (part.strip() for part in str(raw).split(",")):
            found = _parse(name, count, every_gpu)
            out.extend(d for d in found if d not in out)
    if not out:
        raise InvalidDeviceError(f"device {list(names)!r} names no device; use cpu, cuda or cuda:N")
    return out


def _parse(name: str, count: int, every_gpu: list[torch.device]) -> list[torch.device]:
    lowered = name.lower()
    if lowered == "cpu":
        return [torch.device("cpu")]
    if lowered in ("cuda", "gpu", "all"):
        if not every_gpu and lowered != "all":
            raise InvalidDeviceError(f"device {name!r}: torch sees no CUDA device here; use cpu")
        return every_gpu if lowered != "all" else [torch.device("cpu"), *every_gpu]
    index_text = lowered.removeprefix("cuda:")
    if not index_text.isdigit():
        raise InvalidDeviceError(f"device {name!r} is not cpu, cuda, all, cuda:N or a GPU index")
    index = int(index_text)
    if index >= count:
        raise InvalidDeviceError(
            f"device {name!r} does not exist: torch sees {count} CUDA device(s); "
            f"use an index below {count}" if count else
            f"device {name!r} does not exist: torch sees no CUDA device here; use cpu")
    return [every_gpu[index]]
