"""Byte sizes: parse what people type, print what people read.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal units (KB, MB, GB, TB) are powers
of 1000, as on a drive label. A bare number is bytes. ``"10G"`` and ``"10g"`` mean GiB, the way
nvidia-smi and most people mean it.

Usage::

    from devicekit.units import parse_size, format_size

    parse_size("20GiB")      # 21474836480
    parse_size("512MB")      # 512000000
    parse_size(1024)         # 1024
    format_size(1536 * 2**20)  # '1.5 GiB'
"""

from __future__ import annotations

import math
import re

from devicekit.errors import InvalidSizeError

__all__ = ["parse_size", "format_size", "parse_percent"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float, *, name: str = "size") -> int:
    """Return ``value`` in bytes; raise :class:`InvalidSizeError` naming it if malformed."""
    if isinstance(value, bool):
        raise InvalidSizeError(f"{name} {value!r} is not a size; write e.g. '20GiB' or '512MB'")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise InvalidSizeError(f"{name} {value!r} must be a non-negative number of bytes")
        return int(value)
    if not isinstance(value, str):
        raise InvalidSizeError(f"{name} {value!r} is not a size; write e.g. '20GiB' or '512MB'")
    match = _SIZE_RE.match(value)
    if not match:
        raise InvalidSizeError(f"{name} {value!r} is not a size; write e.g. '20GiB' or '512MB'")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise InvalidSizeError(
            f"{name} {value!r} has unknown unit {unit!r}; use B, KiB, MiB, GiB, TiB (or KB, MB, GB, TB)"
        )
    amount = float(number) * factor
    if not math.isfinite(amount):  # "1e400GiB": no machine has that much, and int() would crash
        raise InvalidSizeError(f"{name} {value!r} is too large to be a size; write e.g. '20GiB'")
    return int(amount)


def format_size(num_bytes: int | float, *, precision: int = 1) -> str:
    """Format a byte count with binary units: ``1536 -> '1.5 KiB'``; negatives keep their sign."""
    sign = "-" if num_bytes < 0 else ""
    value = float(abs(num_bytes))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            text = f"{value:.{precision}f}".rstrip("0").rstrip(".")
            return f"{sign}{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_percent(value: str | int | float, *, name: str = "percentage") -> float:
    """Parse ``80``, ``"80"`` or ``"80%"`` into 80.0; raise naming the value if outside 0-100."""
    text = str(value).strip().rstrip("%") if not isinstance(value, bool) else "x"
    try:
        pct = float(text)
    except ValueError:
        raise InvalidSizeError(f"{name} {value!r} is not a percentage; write e.g. 50 or '50%'") from None
    if not 0 <= pct <= 100 or math.isnan(pct):
        raise InvalidSizeError(f"{name} {value!r} must be between 0 and 100")
    return pct
