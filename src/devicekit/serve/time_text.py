"""Times as the pages show them: ``14:02`` for a clock time, ISO for ``<time>``.

Shared by the status page (:mod:`~devicekit.serve.page`) and the lab page
(:mod:`~devicekit.serve.lab_page`), so both say a time the same way (a duration is
:func:`devicekit.units.format_duration`, as everywhere else).

Usage::

    from devicekit.serve.time_text import clock, iso

    clock(time.time())      # '14:02' (a date too when not today)
    iso(0)                  # '1970-01-01T00:00:00Z', for <time datetime=...>
"""

from __future__ import annotations

import time

__all__ = ["iso", "clock"]


def iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def clock(epoch: float) -> str:
    return time.strftime("%H:%M" if abs(time.time() - epoch) < 86400 else "%Y-%m-%d %H:%M",
                         time.localtime(epoch))
