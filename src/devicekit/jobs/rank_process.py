"""The child side of ``dk.launch``: one rank's process, from start to its reported result.

Before anything else the rank arranges to die with its parent (``PR_SET_PDEATHSIG`` on Linux,
plus a thread watching the parent's pid everywhere), so no rank is ever orphaned; it registers
``faulthandler`` on SIGUSR1 so the parent's hang watchdog can ask for every thread's Python
stack; it sets its rank variables (and CUDA_VISIBLE_DEVICES) *before* unpickling the user's
function, so CUDA sees only this rank's GPU(s); then it optionally joins the process group,
sends ``("ready",)``, runs the function and sends ``("ok", value)`` or
``("error", summary, traceback, time)`` back. Messages are plain pickles (``send_bytes``), not
multiprocessing's: a tensor travels by value instead of as a shared-memory handle that dies
with the rank.

Usage (internal; ``dk.launch`` starts it through multiprocessing's spawn context)::

    ctx.Process(target=rank_main, args=(payload, variables, conn, stack_path, os.getpid()))
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any

__all__ = ["rank_main", "die_with_parent", "STACK_SIGNAL"]

#: the signal the parent sends to ask a rank for its Python stacks
STACK_SIGNAL = signal.SIGUSR1
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Make this process die when ``parent_pid`` does (kernel hook on Linux, a thread elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), sig)
            time.sleep(0.5)

    threading.Thread(target=watch, name="devicekit-parent-watch", daemon=True).start()
    if os.getppid() != parent_pid:  # the parent died before the hook was in place
        os.kill(os.getpid(), sig)


def _limit_threads(threads: str | None) -> None:
    """Apply ``OMP_NUM_THREADS`` to a torch the rank imported before it was set (spawn re-runs
    the caller's imports); a torch imported later reads the variable itself."""
    torch = sys.modules.get("torch")
    if threads and torch is not None:
        torch.set_num_threads(int(threads))


def rank_main(
    payload: bytes,
    variables: dict[str, str],
    conn: Any,
    stack_path: str,
    parent_pid: int,
    backend: str | None,
) -> None:
    """Run one rank: set up, call the function, report. Exits 0 even when the function raised
    (the error travels through ``conn``); a rank that cannot report exits non-zero."""
    die_with_parent(parent_pid)
    stack_file = open(stack_path, "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True, chain=False)
    os.environ.update(variables)
    rank = int(variables.get("RANK", "0"))

    def send(message: tuple[Any, ...]) -> None:
        conn.send_bytes(pickle.dumps(message))

    try:
        try:
            fn, args, kwargs = pickle.loads(payload)
        except Exception as exc:  # noqa: BLE001 - e.g. a function defined in a notebook
            raise RuntimeError(
                f"the rank cannot load the function to run ({type(exc).__name__}: {exc}); define it"
                " at module level in an importable file (spawned ranks re-import it)"
            ) from None
        _limit_threads(variables.get("OMP_NUM_THREADS"))
        if backend is not None:
            import torch.distributed  # noqa: F401 - slow on a busy machine; not the job's time
        send(("ready",))  # started: the hang watchdog's clock runs from here
        if backend is not None:
            from devicekit.parallel import dist

            dist.init(backend)
        value = fn(*args, **kwargs)
        message: tuple[Any, ...] = ("ok", value)
    except SystemExit as exc:  # sys.exit() in a rank: 0/None is a normal end, anything else fails
        if exc.code in (0, None):
            message = ("ok", None)
        else:
            message = ("error", f"SystemExit: {exc.code}", traceback.format_exc(), time.time())
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent
        summary = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        # time-stamped here, before the group is torn down: the parent blames the earliest
        message = ("error", summary, traceback.format_exc(), time.time())
    try:
        send(message)
    except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
        send(("error", f"rank {rank} returned a value that cannot be sent back: {exc}",
              traceback.format_exc(), time.time()))
    finally:
        conn.close()
    if backend is not None:
        from devicekit.parallel import dist

        try:
            dist.destroy()
        except Exception:  # noqa: BLE001 - the result is already delivered
            pass
    from devicekit.parallel.clean_exit import exit_without_teardown

    exit_without_teardown(0)  # the result is delivered: no teardown that could abort now

