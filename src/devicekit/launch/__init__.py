"""devicekit.launch: starting and supervising the processes of a job.

Everything ``devicekit run`` and ``dk.launch`` do before and around the ranks: read what was
asked (``request``), the world an outer launcher (srun, mpirun, torchrun, a Kubeflow pod) already
set (``outer``, ``run_world``), lease devices and share them among processes (``allocation``),
build and start the command, directly or under torchrun (``run``, ``torchrun_entry``), and
supervise it: signals, exit codes, no orphans (``supervise``); ``dk.launch(fn)`` from Python with
its rank processes (``launch``, ``rank_process``) and thread counts (``threads``).
What runs *inside* a rank (process group, DDP, FSDP) is :mod:`devicekit.parallel`, one floor down.

May import: ``units``, ``errors``, ``hardware``, ``placement``, ``memory``, ``parallel``. Never
``strategy``, ``cli``, ``integrations``.

Usage::

    import devicekit as dk
    from devicekit.launch.run import RunRequest, plan_run, run

    results = dk.launch(train, nprocs=2, timeout=600)          # Python: supervised ranks
    code = run(RunRequest(gpus=2, command=["python", "train.py"]))   # what `devicekit run` does
    plan = plan_run(RunRequest(procs=2, command=["python", "x.py"]))  # leases, starts nothing
    plan.allocation.release()
"""

import sys as _sys
import types as _types
from typing import Any as _Any


class _LaunchPackage(_types.ModuleType):
    """This package, callable as ``dk.launch``: importing ``devicekit.launch.<module>`` sets the
    package as ``devicekit.launch``, over the lazily exported function of the same name, and
    ``dk.launch(fn, ...)`` must keep working after any such import."""

    def __call__(self, *args: _Any, **kwargs: _Any) -> _Any:
        from devicekit.launch.launch import launch

        return launch(*args, **kwargs)


_sys.modules[__name__].__class__ = _LaunchPackage
