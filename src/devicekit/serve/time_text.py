"""Times as the pages show them: ``1h 2m`` for a duration, ``14:02`` for a clock time.

Shared by the status page (:mod:`~devicekit.serve.page`) and the lab page
(:mod:`~devicekit.serve.lab_page`), so both say a time the same way.

Usage::

    from devicekit.serve.time_text import clock, duration, iso

    duration(3720)          # '1h 2m'
    clock(time.time())      # '14:02' (a date too when not today)
    iso(0)                  # '1970-01-01T00:00:00Z', for <time datetime=...>
"""

from __future__ import annotations

import time

__all__ = ["iso", "clock", "duration"]


def iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def clock(epoch: float) -> str:
    return time.strftime("%H:%M" if abs(time.time() - epoch) < 86400 else "%Y-%m-%d %H:%M",
                         time.localtime(epoch))


def duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"
