"""End a rank whose work is done without the interpreter's teardown, which can abort in torch.

On torch 2.13 (CPU, gloo) a two-rank job that has done all its work now and then aborts at
interpreter exit with "terminate called without an active exception" (SIGABRT, exit 134). After
``destroy_process_group()`` a rank still runs torch's two gloo worker threads, gloo's TCP loop
and, where it hosts the store, the store's libuv thread (a DDP model still holds the group; seen
with gdb), so their teardown happens during the interpreter's own, where a C++ thread that needs
Python then is ended by force. :func:`exit_without_teardown` runs the exit
work that matters (``atexit`` handlers, multiprocessing's finalizers, flushing stdout/stderr)
and then leaves with ``os._exit``, so nothing of torch is torn down.

Usage::

    import devicekit as dk

    dk.dist.destroy()
    dk.dist.exit_without_teardown(0)       # the last line of a training script
"""

from __future__ import annotations

import atexit
import os
import sys

__all__ = ["exit_without_teardown"]


def exit_without_teardown(code: int = 0) -> None:
    """Run the ``atexit`` handlers, flush stdout/stderr and ``os._exit(code)``; never returns."""
    try:
        atexit._run_exitfuncs()  # multiprocessing's finalizers, logging's flush, the user's
    except Exception:  # noqa: BLE001, S110 - nothing may stop the exit now
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
