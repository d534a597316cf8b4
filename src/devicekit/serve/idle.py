"""Leased but idle: since when each lease's GPU has done nothing, as the sampler saw it.

A status document is one instant; "idle for 30 minutes" needs the instants before it. The
sampler hands every new document to :meth:`IdleTracker.annotate`, which gives each lease on a
GPU an ``idle_since`` (seconds since the epoch): the first sample, of an unbroken run, in which
the GPU's utilization was below :data:`IDLE_BELOW` percent while the lease held it; ``null``
while the GPU is busy, or where the driver does not report utilization (a GPU in MIG mode).
A lease first seen idle counts from that sample: what came before the server started is not
known. ``/metrics`` turns it into ``devicekit_lease_idle_seconds``, the page into "GPU idle
for 35m".

Usage::

    from devicekit.serve.idle import IdleTracker

    tracker = IdleTracker()
    doc = tracker.annotate(collect_status().to_dict())    # the same dict, leases annotated
    doc["gpus"][0]["leases"][0]["idle_since"]
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["IdleTracker", "IDLE_BELOW", "is_idle"]

#: a GPU below this utilization (percent, the driver's few-second average) is idle
IDLE_BELOW = 5.0

_Key = tuple[str, Any, Any]


def is_idle(gpu: dict[str, Any]) -> bool | None:
    """Whether the GPU is idle now; None where its utilization is not known."""
    util = gpu.get("utilization")
    if isinstance(util, bool) or not isinstance(util, int | float):
        return None
    return float(util) < IDLE_BELOW


class IdleTracker:
    """Remembers, between samples, since when each lease's GPU has been idle."""

    def __init__(self) -> None:
        self._since: dict[_Key, float] = {}

    def annotate(self, doc: dict[str, Any]) -> dict[str, Any]:
        """Set ``idle_since`` on every lease of every GPU of ``doc`` (changed in place)."""
        now = float(doc.get("taken_at") or time.time())
        seen: dict[_Key, float] = {}
        for gpu in doc.get("gpus", []):
            idle = is_idle(gpu)
            for lease in gpu.get("leases", []):
                key = (str(lease.get("gpu_uuid")), lease.get("pid"), lease.get("since"))
                if idle:
                    seen[key] = self._since.get(key, now)
                lease["idle_since"] = seen.get(key)
        self._since = seen  # leases gone, or busy again, start over
        return doc
