"""CPU threads per process when several processes share a node.

torchrun (and devicekit's own launcher) start several processes per node; each would use every
core for OpenMP, so they fight over them. devicekit sets ``OMP_NUM_THREADS`` to the usable cores
(this process's affinity) divided by the processes per node, unless the user set it.

Usage::

    from devicekit.jobs.threads import omp_threads
    env.setdefault("OMP_NUM_THREADS", str(omp_threads(nprocs)))
"""

from __future__ import annotations

import os

__all__ = ["usable_cores", "omp_threads"]


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity where known, else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def omp_threads(nprocs: int) -> int:
    """OpenMP threads for each of ``nprocs`` processes on this node (at least 1)."""
    return max(1, usable_cores() // max(1, nprocs))
