"""End a rank whose work is done without an abort in torch's teardown at interpreter exit.

Two ways out, both used by devicekit (the cause is in :mod:`devicekit.teardown`):

* ``settle_backend_threads`` (:mod:`devicekit.teardown`) waits, bounded, until torch's
  gloo worker threads are idle, so none frees a work during the teardown: ``import devicekit``
  registers it at exit and ``dk.dist.destroy()`` calls it.
* :func:`exit_without_teardown` runs the exit work that matters (``atexit`` handlers,
  multiprocessing's finalizers, flushing stdout/stderr) and leaves with ``os._exit``: what
  ``dk.launch``'s ranks, ``devicekit run``'s torchrun agent and the bundled example do once
  their result is delivered.

Usage::

    import devicekit as dk

    dk.dist.destroy()                      # waits for torch's gloo threads to settle
    dk.dist.exit_without_teardown(0)       # optional: the last line of a training script
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
