"""Persistent worker threads, one per pipeline stage, that hand micro-batches straight on.

Each stage gets its own thread (also when two stages share a device: ``["cpu", "cpu"]``
overlaps on two cores), started on first use and reused by every later call. A call feeds the
micro-batches to stage 0's queue; each stage runs them in order and passes each result directly
to the next stage's queue, so stage ``j`` works on micro-batch ``i`` once stage ``j - 1`` has
finished it and it has finished micro-batch ``i - 1``: GPipe's clock order, without waking the
caller between ticks. Tasks run with the caller's grad mode, inference mode and autocast state (thread-local in
torch), on the stage's CUDA device; between CUDA devices activations move on side copy streams
(:mod:`devicekit.modelparallel.copy_streams`). Busy time is measured per stage. An error stops the
call's remaining work and is re-raised in the caller with its traceback, after every stage is
done with the call. Threads are daemons and stop on :meth:`StageWorkers.close`, or when the
``StageWorkers`` object is garbage-collected (their loop holds no reference to it).

Usage::

    from devicekit.modelparallel.worker import StageWorkers

    workers = StageWorkers(devices)
    outputs, busy = workers.run(lambda stage, i, x: parts[stage](x), micro_batches)
    workers.close()                 # joins the threads; a later run starts new ones
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch

from devicekit.modelparallel.copy_streams import CopyStreams, Marks, mark, tensors_in

__all__ = ["StageWorkers"]

_STOP = object()
_SKIPPED = object()
_JOIN_SECONDS = 10.0


class _Job:
    """One call's state, shared by the stage threads; holds no reference to the threads."""

    def __init__(self, task: Callable[[int, int, Any], Any], stages: int, devices: Sequence[torch.device]) -> None:
        self.task: Callable[[int, int, Any], Any] | None = task
        self.last = stages - 1
        self.devices = devices
        self.busy = [0.0] * stages
        self.failure: BaseException | None = None
        self.done: queue.SimpleQueue[tuple[int, Any, Marks]] = queue.SimpleQueue()
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = [(kind, torch.get_autocast_dtype(kind))
                         for kind in sorted({d.type for d in devices})
                         if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind)]

    def step(self, stage: int, index: int, value: Any, marks: Marks, copies: CopyStreams,
             onward: queue.SimpleQueue[Any]) -> None:
        """Run stage ``stage`` on micro-batch ``index`` and pass the result on."""
        if self.failure is not None or value is _SKIPPED or self.task is None:
            value, marks = _SKIPPED, ()
        else:
            start = time.perf_counter()
            try:
                if torch.is_grad_enabled() != self.grad:  # thread-local; stays set for the next task
                    torch.set_grad_enabled(self.grad)
                with ExitStack() as stack:
                    if self.inference:
                        stack.enter_context(torch.inference_mode())
                    for kind, dtype in self.autocast:
                        stack.enter_context(torch.autocast(kind, dtype=dtype))
                    value = copies.receive(value, self.devices[stage], marks)
                    value = self.task(stage, index, value)
                marks = mark(value) if self.devices[stage].type == "cuda" else ()
            except BaseException as exc:  # handed to the caller, who re-raises it
                if self.failure is None:
                    self.failure = exc
                value, marks = _SKIPPED, ()
            self.busy[stage] += time.perf_counter() - start
        if stage == self.last:
            self.done.put((index, value, marks))
        else:
            onward.put((self, index, value, marks))


def _serve(stage: int, device: torch.device, inbox: queue.SimpleQueue[Any],
           onward: queue.SimpleQueue[Any]) -> None:
    """A stage thread's loop: run what arrives in ``inbox`` until told to stop."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    copies = CopyStreams()
    while True:
        message = inbox.get()
        if message is _STOP:
            return
        job, index, value, marks = message
        del message
        job.step(stage, index, value, marks, copies, onward)
        del job, value, marks  # hold nothing of a finished call while waiting for the next


def _shut_down(inboxes: list[queue.SimpleQueue[Any]], threads: list[threading.Thread]) -> None:
    for inbox in inboxes:
        inbox.put(_STOP)
    me = threading.current_thread()
    for thread in threads:
        if thread is not me:
            thread.join(_JOIN_SECONDS)


class StageWorkers:
    """Stage threads started on first use, reused by every :meth:`run`, stopped by :meth:`close`."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self._threads: list[threading.Thread] = []
        self._inboxes: list[queue.SimpleQueue[Any]] = []
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()  # one call at a time (a failed call restarts the threads)

    @property
    def threads(self) -> list[threading.Thread]:
        """The running stage threads (empty before the first run and after :meth:`close`)."""
        return [t for t in self._threads if t.is_alive()]

    def _start(self) -> None:
        if self._threads and all(t.is_alive() for t in self._threads):
            return
        self.close()
        n = len(self.devices)
        self._inboxes = [queue.SimpleQueue() for _ in range(n)]
        self._threads = [
            threading.Thread(target=_serve, name=f"devicekit-stage-{j}", daemon=True,
                             args=(j, self.devices[j], self._inboxes[j], self._inboxes[(j + 1) % n]))
            for j in range(n)
        ]
        for thread in self._threads:
            thread.start()
        self._finalizer = weakref.finalize(self, _shut_down, self._inboxes, self._threads)

    def run(self, task: Callable[[int, int, Any], Any], inputs: Sequence[Any]) -> tuple[list[Any], list[float]]:
        """``task(stage, index, x)`` through every stage for each input; outputs in order and busy seconds."""
        with self._lock:
            self._start()
            job = _Job(task, len(self.devices), self.devices)
            try:
                for index, value in enumerate(inputs):
                    self._inboxes[0].put((job, index, value, mark(value)))
                outputs: list[Any] = [None] * len(inputs)
                last = self.devices[-1]
                for _ in inputs:
                    index, value, marks = job.done.get()
                    if last.type == "cuda" and marks:  # the caller's stream waits for the last stage
                        for device, event in marks:
                            torch.cuda.current_stream(device).wait_event(event)
                        for t in tensors_in(value):  # and may use the output on its own stream
                            if t.is_cuda:
                                t.record_stream(torch.cuda.current_stream(t.device))
                    outputs[index] = value
            except BaseException as exc:  # e.g. KeyboardInterrupt while waiting: stop this call's work
                if job.failure is None:
                    job.failure = exc
                self.close()
                raise
            finally:
                job.task = None  # the threads may still hold the job for an instant; not the model
            if job.failure is not None:
                self.close()  # no thread outlives a failed call
                raise job.failure
            return outputs, job.busy

    def close(self) -> None:
        """Stop and join the stage threads (idempotent; a later :meth:`run` starts new ones)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._threads, self._inboxes = [], []

