"""Device lists for model parallelism: what ``split``, ``Pipeline`` and ``plan_devices`` accept.

A device is ``"cpu"``, ``"cuda"``, ``"cuda:1"``, an int (``1`` means ``cuda:1``), ``"mps"``,
``"meta"`` or a :class:`torch.device`. Parsing is torch's own (``torch.device``); devicekit adds a
one-line :class:`~devicekit.errors.InvalidDeviceError` for garbage and for CUDA ordinals torch
cannot see. Devices may repeat (two parts on one GPU) and may include ``"cpu"`` (offload).

Usage::

    from devicekit.modelparallel.device_list import parse_devices

    parse_devices(["cuda:0", 1, "cpu"])   # [device('cuda:0'), device('cuda:1'), device('cpu')]
    parse_devices(["cpu", "cpu"])         # two CPU "devices": parts run in their own threads
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from devicekit.errors import InvalidDeviceError
from devicekit.placement.devices import as_device, parse_device_spec

__all__ = ["DeviceLike", "parse_device", "parse_devices"]

DeviceLike = torch.device | str | int


def parse_device(value: Any, *, check: bool = True, name: str = "device") -> torch.device:
    """``value`` as a :class:`torch.device`; ``check`` also asks torch whether it exists.

    Parsing and checking are :func:`devicekit.placement.devices.as_device`'s; without ``check``
    (planning for GPUs this process cannot see) only the spelling is validated.
    """
    try:
        device = as_device(value) if check else parse_device_spec(value)
    except InvalidDeviceError as exc:
        raise InvalidDeviceError(f"{name}: {exc}") from None
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return device


def parse_devices(values: Iterable[Any] | Any, *, check: bool = True) -> list[torch.device]:
    """Parse a list of devices (repeats allowed); an empty list or a lone string is refused."""
    if isinstance(values, (str, int, torch.device)):
        raise InvalidDeviceError(
            f"devices {values!r} is a single device; pass a list such as ['cuda:0', 'cuda:1']"
        )
    try:
        items: Sequence[Any] = list(values)
    except TypeError:
        raise InvalidDeviceError(
            f"devices {values!r} is not a list of devices; pass e.g. ['cuda:0', 'cpu']"
        ) from None
    if not items:
        raise InvalidDeviceError("devices [] is empty; pass at least one device, e.g. ['cpu']")
    return [parse_device(v, check=check, name=f"devices[{i}]") for i, v in enumerate(items)]
