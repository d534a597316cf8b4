"""Catch out-of-memory errors and explain them: :func:`oom_guard` and :func:`install_oom_handler`.

On an OOM (CUDA, CPU allocator, ``MemoryError``) the guard prints a plain-language diagnosis
(:mod:`devicekit.memory.oom_explain`) to stderr, clears the traceback's frames so the tensors
they held are really freed, returns cached blocks to the driver, and re-raises (or, with
``reraise=False``, swallows the error; ``guard.diagnosis`` keeps the explanation). On CUDA it
attaches torch's OOM observer, which captures the allocator's state at the moment of failure.
Other errors pass through untouched.

Usage::

    import devicekit as dk

    with dk.oom_guard():
        train()

    @dk.oom_guard(reraise=False)
    def evaluate(): ...

    dk.install_oom_handler()          # whole process: uncaught OOMs are explained before exiting
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import IO, Any

import torch

from devicekit.hardware.gpu import GPU
from devicekit.memory.oom_explain import OOMDiagnosis, explain
from devicekit.memory.oom_message import is_oom
from devicekit.memory.usage import DeviceMemory

__all__ = ["OOMGuard", "oom_guard", "install_oom_handler", "attach_oom_observer", "last_observed"]

_observed: dict[str, Any] = {}
_observer_attached = False


def _observer(device: int, alloc: int, limit: int, device_free: int) -> None:
    """Called by the CUDA caching allocator just before it raises OutOfMemoryError; ``limit`` is
    the memory-fraction limit if one is set, else the device's total."""
    _observed.clear()
    _observed.update(device=device, requested=alloc, limit=limit, free=device_free, time=time.time())
    try:  # the allocator released its lock before calling observers
        _observed.update(allocated=torch.cuda.memory_allocated(device), reserved=torch.cuda.memory_reserved(device))
    except Exception:
        pass


def attach_oom_observer() -> bool:
    """Attach the observer (now, or when CUDA initialises); True when it is attached now."""
    if _observer_attached:
        return True
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None or not torch.cuda.is_available():
        return False
    if not torch.cuda.is_initialized():
        queue = getattr(torch.cuda, "_lazy_call", None)
        if queue is not None and not _queued:
            _queued.append(True)
            queue(_attach_now)  # runs when CUDA initialises
        return False
    _attach_now()
    return True


_queued: list[bool] = []


def _attach_now() -> None:
    global _observer_attached
    if not _observer_attached:
        torch._C._cuda_attach_out_of_memory_observer(_observer)
        _observer_attached = True


def last_observed(max_age: float = 30.0) -> dict[str, Any] | None:
    """The observer's capture of the latest CUDA OOM, if younger than ``max_age`` seconds."""
    if _observed and time.time() - _observed.get("time", 0) <= max_age:
        return dict(_observed)
    return None


def _frames(tb: types.TracebackType | None) -> list[types.FrameType]:
    found = []
    while tb is not None:
        found.append(tb.tb_frame)
        tb = tb.tb_next
    return found


def _diagnose(exc: BaseException, usage: list[DeviceMemory] | None, gpus: list[GPU] | None, top: int) -> OOMDiagnosis:
    frames = _frames(exc.__traceback__)
    try:
        return explain(exc, usage=usage, gpus=gpus, frames=reversed(frames), top=top, observed=last_observed())
    finally:
        del frames


def _clear_frames(tb: types.TracebackType | None) -> None:
    """``traceback.clear_frames``, plus the ``f_locals`` snapshot of each cleared frame.

    Before Python 3.13, reading ``frame.f_locals`` (the explainer does, to name holders) caches
    a dict on the frame that ``frame.clear()`` leaves alone, so the failed code's tensors stayed
    alive until the exception itself was dropped: after ``empty_cache``, with their memory still
    reserved (seen on an H100). Frames still running (the caller's) are left untouched.
    """
    while tb is not None:
        frame = tb.tb_frame
        try:
            frame.clear()
        except RuntimeError:  # still executing
            pass
        else:
            snapshot = frame.f_locals
            if type(snapshot) is dict and snapshot is not frame.f_globals:
                snapshot.clear()
        tb = tb.tb_next


def _free_after(exc: BaseException) -> None:
    """Drop what the failed code's frames held and hand cached blocks back."""
    _clear_frames(exc.__traceback__)
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class OOMGuard(contextlib.ContextDecorator):
    """Context manager and decorator; see the module docstring. ``usage``/``gpus`` replace the
    live measurements (for tests and replays)."""

    def __init__(self, *, reraise: bool = True, file: IO[str] | None = None, top: int = 5,
                 usage: list[DeviceMemory] | None = None, gpus: list[GPU] | None = None) -> None:
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            from devicekit.errors import InvalidValueError

            # checked now: at the failure a bad value would replace the OOM with its own error
            raise InvalidValueError(f"oom_guard top={top!r} must be a whole number of rows >= 0, e.g. top=5")
        self.reraise = reraise
        self.file = file
        self.top = top
        self.usage = usage
        self.gpus = gpus
        self.diagnosis: OOMDiagnosis | None = None

    def __enter__(self) -> OOMGuard:
        attach_oom_observer()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: types.TracebackType | None) -> bool:
        if exc is None or not is_oom(exc):
            return False
        try:
            self.diagnosis = _diagnose(exc, self.usage, self.gpus, self.top)
        except Exception as err:  # the OOM is what the caller must see, never our own failure
            print(f"devicekit: could not explain this out-of-memory error ({type(err).__name__}: {err})",
                  file=self.file or sys.stderr, flush=True)
        else:
            print(self.diagnosis.text(), file=self.file or sys.stderr, flush=True)
            with contextlib.suppress(AttributeError, TypeError):
                exc.devicekit_diagnosis = self.diagnosis  # type: ignore[union-attr]
        finally:
            _free_after(exc)
        return not self.reraise


def oom_guard(fn: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """``with oom_guard(): ...``, ``@oom_guard`` or ``@oom_guard(reraise=False)``."""
    if fn is not None:
        if not callable(fn):
            from devicekit.errors import InvalidValueError

            raise InvalidValueError(f"oom_guard({fn!r}): pass a function to decorate, or options by name")
        return OOMGuard(**options)(fn)
    return OOMGuard(**options)


_installed: dict[str, Any] = {}


def install_oom_handler(*, file: IO[str] | None = None, top: int = 5) -> Callable[[], None]:
    """Explain uncaught OOMs (main thread and threads) before the normal traceback.

    Chains the hooks already installed; returns a function that restores them. Calling it again
    returns the same restore function.
    """
    if _installed:
        return _installed["uninstall"]
    previous_hook = sys.excepthook
    previous_thread_hook = threading.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: types.TracebackType | None) -> None:
        if is_oom(exc):
            with contextlib.suppress(Exception):
                print(_diagnose(exc, None, None, top).text(), file=file or sys.stderr, flush=True)
        previous_hook(exc_type, exc, tb)

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if is_oom(args.exc_value):
            with contextlib.suppress(Exception):
                print(_diagnose(args.exc_value, None, None, top).text(), file=file or sys.stderr, flush=True)
        previous_thread_hook(args)

    def uninstall() -> None:
        if sys.excepthook is hook:
            sys.excepthook = previous_hook
        if threading.excepthook is thread_hook:
            threading.excepthook = previous_thread_hook
        _installed.clear()

    sys.excepthook = hook
    threading.excepthook = thread_hook
    attach_oom_observer()
    _installed["uninstall"] = uninstall
    return uninstall
