"""Micro-batch threads for a pipeline run by hooks: stage turnstiles, and backward in the unsplit order.

:mod:`~devicekit.modelparallel.block_pipeline` runs the model's own forward once per micro-batch,
micro-batch ``i`` always in thread ``i`` of a :class:`MicroThreads` pool (threads started on
first use, kept for later calls, stopped by :meth:`MicroThreads.close` or garbage collection).

* :class:`Turnstile`: one call's stage order. Micro-batch ``i`` enters stage ``k`` only after
  micro-batch ``i - 1`` left it (GPipe's order); a stage a micro-batch never enters (its first
  module was not called) is passed through in order; a failure wakes every waiting thread.
* Backward order. torch numbers autograd nodes per thread (``sequence_nr``) and runs ready
  nodes highest number first, so gradients reaching one parameter from several micro-batches
  (every parameter, with 3 or more; a tied embedding and head, with 2) are summed in the order
  of those numbers. Run in one thread, micro-batch ``i``'s nodes are all numbered above
  micro-batch ``i - 1``'s; in threads they would overlap and the sums come out in another order
  (different in the last bits). So before micro-batch ``i`` creates a node, its thread's counter
  is moved past where micro-batch ``i - 1``'s will end (its start, plus twice the nodes it
  created last time, plus a margin: :meth:`MicroThreads.space`), by creating throw-away nodes.
  Counters only grow and every thread creates about as many per call, so after the first calls
  nothing needs moving. The first call that records gradients runs its micro-batches in the
  calling thread, which counts each one's nodes.

Usage::

    pool = MicroThreads()
    gate = Turnstile(stages=2, devices=devices)
    pool.run([lambda i=i: work(i, gate) for i in range(4)])   # work calls gate.move(...), pool.space(i)
    pool.close()
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import ExitStack

import torch

__all__ = ["Turnstile", "SerialStages", "MicroThreads", "Cancelled", "caller_modes", "enter_modes",
           "autograd_counter"]

_STOP = object()
_JOIN_SECONDS = 10.0
Modes = tuple[bool, bool, list[tuple[str, torch.dtype]]]


def autograd_counter() -> int:
    """This thread's next autograd node number."""
    return int(torch._C._autograd._get_sequence_nr())


class Cancelled(Exception):
    """Another micro-batch failed: this one stops where it waits."""


class Turnstile:
    """One call's stage order: per stage, the micro-batch allowed in next (see the module doc)."""

    def __init__(self, stages: int, devices: Sequence[torch.device]) -> None:
        self.cond = threading.Condition()
        self.next = [0] * stages
        self.devices = devices
        self.busy = [0.0] * stages
        self.since: dict[int, float] = {}
        self.failure: BaseException | None = None

    def _wait(self, index: int, stage: int) -> None:
        while self.next[stage] != index:
            if self.failure is not None:
                raise Cancelled
            self.cond.wait()

    def move(self, index: int, current: int, stage: int) -> None:
        """Micro-batch ``index`` leaves stage ``current`` (-1: none yet) for ``stage`` (len: done)."""
        now = time.perf_counter()
        with self.cond:
            if current >= 0:
                self.busy[current] += now - self.since.pop(index, now)
                self.next[current] = index + 1
            for skipped in range(current + 1, min(stage, len(self.next))):  # not called: passed through
                self._wait(index, skipped)
                self.next[skipped] = index + 1
            self.cond.notify_all()
            if stage < len(self.next):
                self._wait(index, stage)
                self.since[index] = time.perf_counter()
        if stage < len(self.devices) and self.devices[stage].type == "cuda":
            torch.cuda.set_device(self.devices[stage])

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = exc
            self.cond.notify_all()


class SerialStages:
    """Stage bookkeeping for micro-batches run one after another in the calling thread: busy time."""

    def __init__(self, stages: int) -> None:
        self.busy = [0.0] * stages
        self.since = 0.0

    def move(self, index: int, current: int, stage: int) -> None:
        now = time.perf_counter()
        if 0 <= current < len(self.busy):
            self.busy[current] += now - self.since
        self.since = now


def caller_modes() -> Modes:
    """This thread's grad, inference and autocast modes (thread-local in torch), for another thread."""
    autocast = [(kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda") if torch.is_autocast_enabled(kind)]
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast


def enter_modes(stack: ExitStack, modes: Modes) -> None:
    """Put ``modes`` (from :func:`caller_modes`) in place in this thread until ``stack`` closes."""
    grad, inference, autocast = modes
    stack.enter_context(torch.set_grad_enabled(grad))  # made here: it sets this thread's mode
    if inference:
        stack.enter_context(torch.inference_mode())
    for kind, dtype in autocast:
        stack.enter_context(torch.autocast(kind, dtype=dtype))


def _serve(inbox: queue.SimpleQueue[object]) -> None:
    while True:
        task = inbox.get()
        if task is _STOP:
            return
        try:
            task()  # type: ignore[operator]
        finally:
            del task


def _shut_down(inboxes: list[queue.SimpleQueue[object]], threads: list[threading.Thread]) -> None:
    for inbox in inboxes:
        inbox.put(_STOP)
    me = threading.current_thread()
    for thread in threads:
        if thread is not me:
            thread.join(_JOIN_SECONDS)


class MicroThreads:
    """Thread ``i`` runs micro-batch ``i`` of every call (see the module doc)."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._inboxes: list[queue.SimpleQueue[object]] = []
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()
        #: per micro-batch index, the autograd nodes its forward created last time
        self.nodes: dict[int, int] = {}
        self._starts: dict[int, int] = {}

    @property
    def threads(self) -> list[threading.Thread]:
        return [t for t in self._threads if t.is_alive()]

    def _grow(self, count: int) -> None:
        if self._threads and not all(t.is_alive() for t in self._threads):
            self.close()
        while len(self._threads) < count:
            inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
            thread = threading.Thread(target=_serve, args=(inbox,), daemon=True,
                                      name=f"devicekit-microbatch-{len(self._threads)}")
            thread.start()
            self._inboxes.append(inbox)
            self._threads.append(thread)
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _shut_down, list(self._inboxes), list(self._threads))

    def run(self, tasks: Sequence[Callable[[], None]]) -> None:
        """Run ``tasks[i]`` in thread ``i``; return when all are done (they handle their own errors)."""
        with self._lock:
            self._grow(len(tasks))
            self._starts = {}
            done = threading.Semaphore(0)

            def wrapped(task: Callable[[], None]) -> Callable[[], None]:
                def call() -> None:
                    try:
                        task()
                    finally:
                        done.release()
                return call

            for inbox, task in zip(self._inboxes, tasks, strict=False):
                inbox.put(wrapped(task))
            for _ in tasks:
                done.acquire()

    def ready(self, count: int) -> bool:
        """True when the node counts of micro-batches ``0..count-2`` are known (spacing can work)."""
        return all(i in self.nodes for i in range(count - 1))

    def space(self, index: int) -> None:
        """Before micro-batch ``index`` creates autograd nodes: move this thread's counter past
        micro-batch ``index - 1``'s (see the module doc)."""
        if index > 0 and (index - 1) in self._starts and torch.is_grad_enabled():
            need = self._starts[index - 1] + 2 * self.nodes.get(index - 1, 0) + 64 - autograd_counter()
            if need > 0:
                x = torch.empty(0, requires_grad=True)
                for _ in range(need):
                    x.view(0)
        self._starts[index] = autograd_counter()

    def counted(self, index: int, start: int) -> None:
        """Micro-batch ``index``'s forward is done; it began at node ``start`` of this thread."""
        self.nodes[index] = autograd_counter() - start

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._threads, self._inboxes = [], []

    def __getstate__(self) -> dict[str, object]:  # copy.deepcopy / pickle: threads stay behind
        return {"nodes": dict(self.nodes)}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__()  # type: ignore[misc]
        self.nodes.update(state["nodes"])  # type: ignore[arg-type]
