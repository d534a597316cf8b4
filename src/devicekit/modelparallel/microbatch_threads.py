"""The pipeline's micro-batch threads: stage turnstiles, backward in the unsplit order, one runner.

Both of :class:`~devicekit.modelparallel.pipeline.Pipeline`'s engines (the traced chain of parts,
:mod:`~devicekit.modelparallel.chain_pipeline`, and the model's own forward cut by hooks,
:mod:`~devicekit.modelparallel.block_pipeline`) hand :class:`MicroBatchRunner` one function per
call, ``body(i, stages)``, that runs micro-batch ``i`` through every stage (it is in stage 0
when the body starts) and calls ``stages.enter(i, k)`` as it reaches stage ``k``. The runner runs micro-batch ``i`` always in
thread ``i`` of its :class:`MicroThreads` pool (started on first use, kept for later calls,
stopped by :meth:`MicroBatchRunner.close`, by garbage collection, or by a failed call), or
one after another in the calling thread when nothing can overlap.

* :class:`Turnstile`: one call's stage order. Micro-batch ``i`` enters stage ``k`` only after
  micro-batch ``i - 1`` left it (GPipe's clock order: at tick ``t`` stage ``k`` works on
  micro-batch ``t - k``); a stage a micro-batch never enters is passed through in order; a failure
  wakes every waiting thread, and the call's error reaches the caller once every thread stopped.
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
* Random draws. Stages that share a generator (two CPU stages, two on one GPU) would draw from
  it in an order that changes from call to call, so dropout's masks (and checkpointing's replay
  of them) would differ with the same seed. While a layer that draws is in training mode, or
  once a call saw a shared generator move, micro-batches run one after another in the calling
  thread: the draws of the unpipelined order, every call (a call that saw draws only after
  overlapping is discarded and run again in order, once: the runner remembers). Masks drawn
  per micro-batch are not the unsplit model's whole-batch masks: a warning says so once.

Usage::

    runner = MicroBatchRunner(devices)
    outputs, busy = runner.run(4, body, random_active=False, records_grad=True, discard=lambda: None)
    runner.close()
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, Protocol

import torch
from torch import nn

from devicekit.modelparallel.recompute import PipelineDiffers, drew_random_numbers, generator_states
from devicekit.placement.walk import map_tensors

__all__ = ["MicroBatchRunner", "Stages", "records_grad", "Turnstile", "SerialStages", "MicroThreads", "caller_modes",
           "enter_modes", "autograd_counter"]

_STOP = object()
_JOIN_SECONDS = 10.0
Modes = tuple[bool, bool, list[tuple[str, torch.dtype]]]


def autograd_counter() -> int:
    """This thread's next autograd node number."""
    return int(torch._C._autograd._get_sequence_nr())


class Cancelled(Exception):
    """Another micro-batch failed: this one stops where it waits."""


class Stages(Protocol):
    """Where each micro-batch of one call is: :class:`Turnstile` (threads) or :class:`SerialStages`."""

    ordered: bool  # True: stages must be entered once each, in order

    def at(self, index: int) -> int: ...

    def enter(self, index: int, stage: int) -> None: ...


class Turnstile:
    """One call's stage order: per stage, the micro-batch allowed in next (see the module doc)."""

    ordered = True

    def __init__(self, stages: int, devices: Sequence[torch.device]) -> None:
        self.lock = threading.Lock()
        self.conds: dict[int, threading.Condition] = {}  # per micro-batch: only i + 1 waits for i
        self.next = [0] * stages
        self.devices = devices
        self.busy = [0.0] * stages
        self.since: dict[int, float] = {}
        self.where: dict[int, int] = {}
        self.failure: BaseException | None = None

    def at(self, index: int) -> int:
        """The stage micro-batch ``index`` is in (-1: none yet)."""
        return self.where.get(index, -1)

    def _cond(self, index: int) -> threading.Condition:
        found = self.conds.get(index)
        if found is None:
            found = self.conds[index] = threading.Condition(self.lock)
        return found

    def _wait(self, index: int, stage: int) -> None:
        while self.next[stage] != index:
            if self.failure is not None:
                raise Cancelled
            self._cond(index).wait()

    def enter(self, index: int, stage: int) -> None:
        """Micro-batch ``index`` leaves its stage for ``stage`` (the number of stages: done)."""
        current = self.at(index)
        if stage == current:
            return
        self.where[index] = stage
        now = time.perf_counter()
        with self.lock:
            if current >= 0:
                self.busy[current] += now - self.since.pop(index, now)
                self.next[current] = index + 1
                self._cond(index + 1).notify_all()  # the only micro-batch that can now go on
            for skipped in range(current + 1, min(stage, len(self.next))):  # not called: passed through
                self._wait(index, skipped)
                self.next[skipped] = index + 1
                self._cond(index + 1).notify_all()
            if stage < len(self.next):
                self._wait(index, stage)
                self.since[index] = time.perf_counter()
        if stage < len(self.devices) and self.devices[stage].type == "cuda":
            torch.cuda.set_device(self.devices[stage])

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = exc
            for cond in self.conds.values():
                cond.notify_all()


class SerialStages:
    """Stage bookkeeping for micro-batches run one after another in the calling thread: busy time."""

    ordered = False

    def __init__(self, stages: int) -> None:
        self.busy = [0.0] * stages
        self.since = 0.0
        self.where: dict[int, int] = {}

    def at(self, index: int) -> int:
        return self.where.get(index, -1)

    def enter(self, index: int, stage: int) -> None:
        current = self.at(index)
        if stage <= current:
            return  # one micro-batch at a time: a stage entered again needs no order
        self.where[index] = stage
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


def records_grad(model: nn.Module, inputs: Any) -> bool:
    """True when a forward of ``model`` on ``inputs`` would build an autograd graph."""
    if not torch.is_grad_enabled():
        return False
    if any(p.requires_grad for p in model.parameters()):
        return True
    found: list[bool] = []
    map_tensors(inputs, lambda t: found.append(t.requires_grad) or t)
    return any(found)


def shared_generators(devices: Sequence[torch.device]) -> list[torch.device | None]:
    """The generators two stages draw from: None for the CPU's, a GPU appearing twice."""
    cpu = [None] if sum(d.type == "cpu" for d in devices) > 1 else []
    gpus = sorted({d for d in devices if d.type == "cuda" and list(devices).count(d) > 1}, key=str)
    return [*cpu, *gpus]


class MicroBatchRunner:
    """Runs one call's micro-batches through the stages: in threads, or in order (see the module doc)."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self.pool = MicroThreads()
        self._shared = shared_generators(self.devices)
        self.draws_seen = False  # a call saw a shared generator move: later ones run in order
        self._said_random = False

    @property
    def threads(self) -> list[threading.Thread]:
        return self.pool.threads

    def run(self, count: int, body: Callable[[int, Stages], Any], *, random_active: bool, records_grad: bool,
            discard: Callable[[], None]) -> tuple[list[Any], list[float]]:
        """``body(i, stages)`` for each micro-batch: outputs in order and per-stage busy seconds.

        ``random_active``: a layer known to draw random numbers is training; ``records_grad``: the
        forward builds an autograd graph (grad mode on, a parameter or an input that needs grad);
        ``discard``: forget what a discarded overlapped run recorded (BatchNorm statistics)."""
        n = len(self.devices)
        if random_active and count > 1 and not self._said_random:
            self._said_random = True
            warnings.warn(
                f"dk.Pipeline: dropout draws its masks per micro-batch ({count} per batch), so outputs and "
                "gradients equal the unsplit model's in distribution, not in value, for the same seed; every "
                "call with the same seed gives the same result (model.eval() or chunks=1 for the unsplit draws)",
                PipelineDiffers, stacklevel=6)
        in_order = bool(self._shared) and (self.draws_seen or random_active)
        first_backward = records_grad and torch.is_grad_enabled() and not self.pool.ready(count)
        if count > 1 and n > 1 and not in_order and not first_backward:
            before = [generator_states(d) for d in self._shared]
            outputs, busy = self._overlapped(count, body)
            after = [generator_states(d) for d in self._shared]
            if not any(drew_random_numbers(b, a) for b, a in zip(before, after, strict=True)):
                return outputs, busy
            self.draws_seen = True  # the draws may have interleaved: run again in order
            discard()
        return self._serial(count, body)

    def _serial(self, count: int, body: Callable[[int, Stages], Any]) -> tuple[list[Any], list[float]]:
        stages = SerialStages(len(self.devices))
        outputs = []
        for i in range(count):
            stages.enter(i, 0)
            start = autograd_counter()
            outputs.append(body(i, stages))
            self.pool.counted(i, start)
            stages.enter(i, len(self.devices))
        return outputs, stages.busy

    def _overlapped(self, count: int, body: Callable[[int, Stages], Any]) -> tuple[list[Any], list[float]]:
        gate = Turnstile(len(self.devices), self.devices)
        outputs: list[Any] = [None] * count
        modes = caller_modes()
        pool = self.pool

        def work(i: int) -> None:
            try:
                with ExitStack() as stack:
                    enter_modes(stack, modes)
                    gate.enter(i, 0)  # after micro-batch i - 1 left stage 0, so after its space()
                    pool.space(i)  # this micro-batch's autograd nodes after the previous one's
                    start = autograd_counter()
                    outputs[i] = body(i, gate)
                    pool.counted(i, start)
                    gate.enter(i, len(self.devices))
            except Cancelled:
                pass
            except BaseException as exc:
                gate.fail(exc)

        try:
            pool.run([lambda i=i: work(i) for i in range(count)])
        except BaseException as exc:  # e.g. KeyboardInterrupt while waiting: stop this call's work
            gate.fail(exc)
            pool.close()
            raise
        if gate.failure is not None:
            pool.close()  # no thread outlives a failed call
            raise gate.failure
        return outputs, gate.busy

    def close(self) -> None:
        """Stop the micro-batch threads (a later call starts new ones)."""
        self.pool.close()
