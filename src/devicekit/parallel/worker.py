"""One thread per pipeline stage, so stages on different devices (or CPU cores) overlap.

Each stage gets its own worker thread (also when two stages share a device: ``["cpu", "cpu"]``
overlaps on two cores). A task is a callable; the worker runs it with the caller's grad mode
and autocast state (thread-local settings in torch), on the stage's CUDA device where it has one, and records its
busy time so the schedule's idle fraction can be measured. Errors come back to the caller with
their traceback. Workers live for one ``with`` block and are always joined.

Usage::

    from devicekit.parallel.worker import StageWorkers

    with StageWorkers(devices) as workers:
        workers.submit(0, lambda: part0(x))
        y = workers.result(0)
    workers.busy_seconds          # per stage
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from types import TracebackType
from typing import Any

import torch

__all__ = ["StageWorkers"]

_STOP = object()


class StageWorkers:
    """Worker threads, one per stage; ``submit`` then ``result`` in the same order per stage."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self.busy_seconds = [0.0] * len(self.devices)
        self._in: list[queue.Queue[Any]] = [queue.Queue() for _ in self.devices]
        self._out: list[queue.Queue[Any]] = [queue.Queue() for _ in self.devices]
        self._threads: list[threading.Thread] = []
        self._grad = torch.is_grad_enabled()
        self._autocast: list[tuple[str, torch.dtype]] = []

    def __enter__(self) -> StageWorkers:
        self._grad = torch.is_grad_enabled()
        self._autocast = [(kind, torch.get_autocast_dtype(kind))
                          for kind in sorted({d.type for d in self.devices})
                          if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind)]
        for stage, device in enumerate(self.devices):
            thread = threading.Thread(target=self._run, args=(stage, device),
                                      name=f"devicekit-stage-{stage}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for q in self._in:
            q.put(_STOP)
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def _run(self, stage: int, device: torch.device) -> None:
        torch.set_grad_enabled(self._grad)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        while True:
            task = self._in[stage].get()
            if task is _STOP:
                return
            start = time.perf_counter()
            try:
                with ExitStack() as stack:
                    for kind, dtype in self._autocast:
                        stack.enter_context(torch.autocast(kind, dtype=dtype))
                    result = (True, task())
            except BaseException as exc:  # handed to the caller, who re-raises it
                result = (False, exc)
            self.busy_seconds[stage] += time.perf_counter() - start
            self._out[stage].put(result)

    def submit(self, stage: int, task: Callable[[], Any]) -> None:
        self._in[stage].put(task)

    def result(self, stage: int) -> Any:
        ok, value = self._out[stage].get()
        if not ok:
            raise value
        return value
