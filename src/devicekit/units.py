"""Byte sizes and durations: parse what people type, print what people read.

The rule (docs/sizes.md says it once for users): every unit is binary, as nvidia-smi and
PyTorch's out-of-memory message print them. ``K``, ``KB`` and ``KiB`` all mean 1024 bytes; ``M``,
``MB``, ``MiB`` mean 1024**2; likewise ``G``/``GB``/``GiB`` and ``T``/``TB``/``TiB``, in any case.
A GPU user who writes "20GB" means the 20 GiB nvidia-smi shows, never 10**9 bytes. ``B`` is bytes.

A string must carry its unit: ``"20"`` is refused (20 bytes? 20 GiB?), except ``"0"``. In Python
an ``int`` is an exact byte count, as ``torch.cuda.mem_get_info`` and ``dk.gpus()`` give it; a
float must be a whole number of bytes (``0.5`` is refused). Simulation files are written by
hand, so their sizes must be strings with a unit (``parse_size(..., bare=False)``).

Durations print one way everywhere (status, queue, pages, time limits): the two largest units,
the second two digits wide and left out when zero (``45s``, ``2m05s``, ``1h02m``, ``2h``,
``3d04h``). :func:`format_duration` takes other people's numbers too (a peer's lease age, a
ticket's time limit), so any float gives a short string and none raises.

Usage::

    from devicekit.units import parse_size, format_size

    parse_size("20GiB")      # 21474836480
    parse_size("20GB")       # 21474836480 (the same: GB is read as GiB)
    parse_size("512M")       # 536870912
    parse_size(1024)         # 1024 (an int is bytes)
    format_size(1536 * 2**20)  # '1.5 GiB'
    format_duration(3725)    # '1h02m'
"""

from __future__ import annotations

import math
import re

from devicekit.errors import InvalidSizeError

__all__ = ["parse_size", "format_size", "format_duration", "parse_percent", "SIZE_EXAMPLE"]

#: what every size error suggests
SIZE_EXAMPLE = "write it with a unit, e.g. '20GiB' or '512MiB'"

_UNITS: dict[str, int] = {
    "b": 1,
    "k": 1024, "kb": 1024, "kib": 1024,
    "m": 1024**2, "mb": 1024**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1024**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1024**4, "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float, *, name: str = "size", bare: bool = True) -> int:
    """Return ``value`` in bytes; raise :class:`InvalidSizeError` naming it if malformed.

    ``bare=False`` also refuses Python numbers (for sizes a person typed into a file).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidSizeError(f"{name} {value!r} is not a size; {SIZE_EXAMPLE}")
    if isinstance(value, (int, float)):
        if not bare:
            raise InvalidSizeError(f"{name} {value!r} has no unit; {SIZE_EXAMPLE}")
        if not math.isfinite(value) or value < 0:
            raise InvalidSizeError(f"{name} {value!r} must be a non-negative number of bytes")
        if value != int(value):
            raise InvalidSizeError(
                f"{name} {value!r} is not a whole number of bytes; {SIZE_EXAMPLE}")
        return int(value)
    match = _SIZE_RE.match(value)
    if not match:
        if value.strip().startswith("-") and _SIZE_RE.match(value.strip()[1:]):
            raise InvalidSizeError(f"{name} {value!r} is negative; sizes are 0 or more, e.g. '20GiB'")
        raise InvalidSizeError(f"{name} {value!r} is not a size; {SIZE_EXAMPLE}")
    number, unit = match.groups()
    if not unit:
        if float(number) == 0:
            return 0
        raise InvalidSizeError(f"{name} {value!r} has no unit; {SIZE_EXAMPLE}")
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise InvalidSizeError(
            f"{name} {value!r} has unknown unit {unit!r}; use B, KiB, MiB, GiB or TiB"
            " (K/KB, M/MB, G/GB, T/TB mean the same)"
        )
    amount = float(number) * factor
    if not math.isfinite(amount):  # "1e400GiB": no machine has that much, and int() would crash
        raise InvalidSizeError(f"{name} {value!r} is too large to be a size; {SIZE_EXAMPLE}")
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


#: the longest duration printed as such (about 27 years); anything longer, inf included, is ">9999d"
_MAX_DAYS = 9999


def format_duration(seconds: float) -> str:
    """``45 -> '45s'``, ``125 -> '2m05s'``, ``3725 -> '1h02m'``, ``7200 -> '2h'``, ``0.5 -> '0.5s'``.

    Never raises and stays short: negative is ``'0s'``, NaN or a non-number (``None``, a string,
    a bool) ``'?'``, above 9999 days (inf, 1e300) ``'>9999d'``, below 10 ms ``'<0.01s'``.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return "?"
    if seconds != seconds:  # NaN
        return "?"
    if seconds <= 0:
        return "0s"
    if seconds >= (_MAX_DAYS + 1) * 86400:  # compared as given: an int past float's range too
        return f">{_MAX_DAYS}d"
    if seconds < 1:
        return f"{seconds:.2g}s" if seconds >= 0.01 else "<0.01s"
    total = round(seconds)
    for big, small, size in (("d", "h", 86400), ("h", "m", 3600), ("m", "s", 60)):
        if total >= size:
            high, rest = divmod(total, size)
            low = rest // (size // (24 if big == "d" else 60))
            return f"{high}{big}{low:02d}{small}" if low else f"{high}{big}"
    return f"{total}s"


def parse_percent(value: str | int | float, *, name: str = "percentage") -> float:
    """Parse ``80``, ``"80"`` or ``"80%"`` into 80.0; raise naming the value if outside 0-100.

    A bare value strictly between 0 and 1 (``0.5``) is refused as a fraction written where a
    percent is meant; ``"0.5%"`` is accepted.
    """
    text = str(value).strip().rstrip("%") if not isinstance(value, bool) else "x"
    try:
        pct = float(text)
    except ValueError:
        raise InvalidSizeError(f"{name} {value!r} is not a percentage; write e.g. 50 or '50%'") from None
    if not 0 <= pct <= 100 or math.isnan(pct):
        raise InvalidSizeError(f"{name} {value!r} must be between 0 and 100")
    if 0 < pct < 1 and not str(value).strip().endswith("%"):
        # GPUtil's maxLoad=0.5 habit: a fraction where a percent is meant, not 0.5 %
        raise InvalidSizeError(
            f"{name} {value!r} looks like a fraction; percentages go from 0 to 100: write"
            f" {pct * 100:g} for {pct * 100:g} %, or '{value}%' if you mean {value} %")
    return pct
