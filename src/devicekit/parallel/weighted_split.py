"""Split a batch in proportion to each device's speed, so no fast GPU waits for a slow one.

Seed 003: DataParallel (and any equal split) makes the fast GPU wait. With ``weights`` each
device gets a share of the batch proportional to its weight: ``"auto"`` takes the capability
score (:mod:`devicekit.hardware.capability`: the cached bench, else datasheet peaks), or pass
numbers such as ``[3, 2, 1]``. Shares are whole samples (largest remainder), every device gets
at least one while the batch allows.

Usage::

    from devicekit.parallel.weighted_split import split_sizes, resolve_weights, chunk

    split_sizes(12, [3, 2, 1])                  # [6, 4, 2]
    resolve_weights("auto", [0, 1, 2])          # from the GPUs behind cuda:0..2
    chunk({"x": x, "y": y}, [6, 4, 2], dim=0)   # three dicts of slices
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from devicekit.errors import InvalidValueError

__all__ = ["split_sizes", "resolve_weights", "check_weights", "chunk"]


def split_sizes(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` samples split in proportion to ``weights`` (largest remainder, sum exact)."""
    wsum = float(sum(weights))
    exact = [total * w / wsum for w in weights]
    sizes = [math.floor(e) for e in exact]
    left = total - sum(sizes)
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - sizes[i], reverse=True)[:left]:
        sizes[i] += 1
    # a device with no sample would be skipped by nothing: give it one from the largest share
    for i, size in enumerate(sizes):
        if size == 0 and total >= len(sizes):
            donor = max(range(len(sizes)), key=lambda j: sizes[j])
            sizes[donor] -= 1
            sizes[i] = 1
    return sizes


def resolve_weights(weights: Any, device_ids: Sequence[int]) -> list[float] | None:
    """Validate ``weights`` (None, ``"auto"`` or one positive number per device)."""
    if weights is None:
        return None
    if weights == "auto":
        from devicekit.hardware.capability import capabilities
        from devicekit.hardware.visible import visible_devices

        by_ordinal = {d.ordinal: d.gpu for d in visible_devices()}
        if not all(i in by_ordinal for i in device_ids):
            raise InvalidValueError(
                f"weights='auto' cannot tell which GPUs cuda:{list(device_ids)} are; pass numbers")
        return [c.score for c in capabilities([by_ordinal[i] for i in device_ids])]
    return check_weights(weights, len(device_ids), f"{len(device_ids)} devices", "device")


def check_weights(weights: Any, count: int, for_what: str, each: str) -> list[float]:
    """``weights`` as ``count`` positive floats, or a one-line error (``for_what``: "3 devices")."""
    if isinstance(weights, str) or not isinstance(weights, Sequence):
        raise InvalidValueError(f"weights={weights!r} must be 'auto' or one number per {each}")
    if len(weights) != count:
        raise InvalidValueError(f"weights={list(weights)!r} has {len(weights)} entries for {for_what}")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise InvalidValueError(f"weights={list(weights)!r}: {w!r} is not a positive number")
    return [float(w) for w in weights]


def chunk(obj: Any, sizes: Sequence[int], dim: int = 0) -> list[Any]:
    """``obj`` (tensors, in tuples, lists and dicts) cut into ``len(sizes)`` pieces along ``dim``;
    anything that is not a tensor is repeated in every piece."""
    if isinstance(obj, torch.Tensor):
        return list(torch.split(obj, list(sizes), dim=dim))
    if isinstance(obj, (tuple, list)) and obj:
        parts = [chunk(item, sizes, dim) for item in obj]
        return [type(obj)(p[i] for p in parts) for i in range(len(sizes))]
    if isinstance(obj, dict) and obj:
        parts_by_key = {k: chunk(v, sizes, dim) for k, v in obj.items()}
        return [type(obj)((k, v[i]) for k, v in parts_by_key.items()) for i in range(len(sizes))]
    return [obj for _ in sizes]
