"""A zoo of leaks that only the memory shows, and clean look-alikes, for the leak finder (issue 36).

Each factory returns a fresh :class:`Case`: a step function (no argument) that closes over its
own state, the holder the finder must name, its kind, and the marker of the line that grows it
(``# GROW-<marker>``); clean cases have no holder. ``minor`` cases are slow growth, not leaks.
:func:`storage_growth` is the truth sizes are checked against: the bytes of torch storages made
by a step's ops that stay alive, per step, counted by a dispatch mode with weak references.

Usage::

    case = LEAKS["exception_chain"]()
    report = dk.find_leaks(case.step)
    assert report.leaks[0].holder == case.holder
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tests.memory.memory_truth import LiveStorages  # the live-storage truth of the estimate tests

SOURCE = Path(__file__).read_text().splitlines()
X = torch.randn(8, 16)
Y = torch.randn(8, 4)


class Case(NamedTuple):
    step: Callable[[], None]
    holder: str | None = None
    kind: str | None = None
    marker: str | None = None
    minor: bool = False
    #: words the fix must contain (any one of each tuple)
    fix: tuple[tuple[str, ...], ...] = ()


def line_of(marker: str) -> int:
    hits = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# GROW-{marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def small(width: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))


class State:
    """An object a training script keeps its things on."""

    def __init__(self) -> None:
        self.last_error: BaseException | None = None
        self.grads: list[Any] = []
        self.tracebacks: list[Any] = []


last_out: torch.Tensor | None = None  # the head of the linked list (tensor_attribute_chain)


# -- leaks ------------------------------------------------------------------------------------

def exception_chain() -> Case:
    model, state = small(), State()

    def step() -> None:
        hidden = model(X)  # the traceback's frame keeps it (and its graph)
        try:
            raise RuntimeError(f"bad batch {hidden.shape}")
        except RuntimeError as e:
            e.__cause__ = state.last_error
            state.last_error = e  # GROW-exception_chain

    return Case(step, "state.last_error", "exception_frames", "exception_chain",
                fix=(("str(e)",), ("with_traceback(None)",)))


def tracebacks_kept() -> Case:
    model, state = small(), State()

    def step() -> None:
        hidden = model(X)
        try:
            raise ValueError(f"nan in {hidden.shape}")
        except ValueError:
            state.tracebacks.append(sys.exc_info()[2])  # GROW-tracebacks_kept

    return Case(step, "state.tracebacks", "exception_frames", "tracebacks_kept", fix=(("traceback",),))


def closure_running() -> Case:
    model = small()
    running: Any = 0.0

    def step() -> None:
        nonlocal running
        loss = model(X).pow(2).mean()
        loss.backward()
        model.zero_grad()
        running = 0.98 * running + 0.02 * loss  # GROW-closure_running

    return Case(step, "running", "autograd_graph", "closure_running", fix=((".item()",), ("running value",)))


def tensor_attribute_chain() -> Case:
    global last_out
    last_out = None
    model = small()

    def step() -> None:
        global last_out
        out = model(X)
        out.pow(2).mean().backward()
        out.prev = last_out  # type: ignore[attr-defined]  # GROW-tensor_attribute_chain
        last_out = out

    return Case(step, "last_out", "tensor_attributes", "tensor_attribute_chain", fix=(("deque",),))


def suspended_generators() -> Case:
    model = small()
    pending: list[Iterator[torch.Tensor]] = []

    def predictions() -> Iterator[torch.Tensor]:
        logits = model(X)
        yield logits.argmax(1)
        yield logits.softmax(1)

    def step() -> None:
        gen = predictions()
        next(gen)  # the rest is never asked for: the frame (and logits) stay suspended
        pending.append(gen)  # GROW-suspended_generators

    return Case(step, "pending", "suspended_frames", "suspended_generators", fix=((".close()",),))


class Pause:
    """An awaitable that suspends a coroutine once (what an event loop would resume)."""

    def __await__(self) -> Iterator[None]:
        yield


def suspended_coroutines() -> Case:
    model = small()
    waiting: list[Any] = []

    async def predict() -> torch.Tensor:
        logits = model(X)
        await Pause()
        return logits.sum()

    def step() -> None:
        coro = predict()
        coro.send(None)  # runs to the first await: suspended there with its logits
        waiting.append(coro)  # GROW-suspended_coroutines

    return Case(step, "waiting", "suspended_frames", "suspended_coroutines", fix=((".close()",),))


def numpy_views() -> Case:
    model = small(64)
    arrays: list[Any] = []

    def step() -> None:
        out = model(X)
        out.pow(2).mean().backward()
        arrays.append(out.detach().numpy())  # GROW-numpy_views

    return Case(step, "arrays", "numpy_views", "numpy_views", fix=((".numpy()",),))


def create_graph_results() -> Case:
    model, state = small(64), State()

    def step() -> None:
        loss = model(X).pow(2).mean()
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        state.grads.append(grads)  # GROW-create_graph_results

    return Case(step, "state.grads", None, "create_graph_results", fix=(("create_graph",), ("detach()",)))


def retain_graph_chain() -> Case:
    model = small()
    delta = torch.zeros(8, 16, requires_grad=True)

    def step() -> None:
        nonlocal delta
        loss = model(X + delta).pow(2).mean()
        loss.backward(retain_graph=True)
        model.zero_grad()
        delta = (delta + 0.01 * X).tanh()  # GROW-retain_graph_chain

    return Case(step, "delta", "autograd_graph", "retain_graph_chain", fix=(("retain_graph",), ("detach()",)))


def hook_every_step() -> Case:
    model = small()

    def step() -> None:
        feats: list[torch.Tensor] = []
        model[1].register_forward_hook(lambda m, i, o: feats.append(o))  # GROW-hook_every_step
        model(X).pow(2).mean().backward()
        model.zero_grad()

    return Case(step, "model.1._forward_hooks", "hook_per_step", "hook_every_step", fix=(("remove()",),))


def detached_mse_log() -> Case:
    model = small()
    outs: list[torch.Tensor] = []

    def step() -> None:
        loss = F.mse_loss(model(X), Y)  # 0-d, but its storage is the 8x4 elementwise buffer (CPU)
        loss.backward()
        model.zero_grad()
        outs.append(loss.detach())  # GROW-detached_mse_log

    return Case(step, "outs", None, "detached_mse_log", minor=True, fix=((".clone()", ".item()"),))


LEAKS: dict[str, Callable[[], Case]] = {fn.__name__: fn for fn in (
    exception_chain, tracebacks_kept, closure_running, tensor_attribute_chain, suspended_generators,
    suspended_coroutines, numpy_views, create_graph_results, retain_graph_chain, hook_every_step, detached_mse_log)}


# -- clean look-alikes -----------------------------------------------------------------------------

def sawtooth_outputs() -> Case:
    model = small()
    outputs: list[torch.Tensor] = []

    def step() -> None:
        outputs.append(model(X).detach())
        if len(outputs) == 3:  # used, then emptied: bounded
            outputs.clear()

    return Case(step)


def detached_mse_cleared() -> Case:
    model = small()
    outs: list[torch.Tensor] = []

    def step() -> None:
        loss = F.mse_loss(model(X), Y)
        loss.backward()
        model.zero_grad()
        outs.append(loss.detach())
        if len(outs) == 2:
            outs.clear()

    return Case(step)


def bounded_deque() -> Case:
    model = small()
    recent: collections.deque[torch.Tensor] = collections.deque(maxlen=3)

    def step() -> None:
        recent.append(model(X).detach())

    return Case(step)


def exception_without_traceback() -> Case:
    model, state = small(), State()

    def step() -> None:
        hidden = model(X)
        try:
            raise RuntimeError(f"bad batch {hidden.shape}")
        except RuntimeError as e:
            state.last_error = e.with_traceback(None)

    return Case(step)


def generator_run_to_the_end() -> Case:
    model = small()
    kept: list[list[torch.Tensor]] = []

    def predictions() -> Iterator[torch.Tensor]:
        logits = model(X)
        yield logits.argmax(1)

    def step() -> None:
        kept[:] = [list(predictions())]

    return Case(step)


def numpy_numbers() -> Case:
    model = small()
    values: list[float] = []

    def step() -> None:
        values.append(float(model(X).detach().numpy().mean()))

    return Case(step)


def chain_cut_every_step() -> Case:
    model = small()
    delta = torch.zeros(8, 16, requires_grad=True)

    def step() -> None:
        nonlocal delta
        loss = model(X + delta).pow(2).mean()
        loss.backward(retain_graph=True)
        loss.backward()
        model.zero_grad()
        delta = (delta + 0.01 * X).tanh().detach().requires_grad_()

    return Case(step)


def hook_removed() -> Case:
    model = small()

    def step() -> None:
        feats: list[torch.Tensor] = []
        handle = model[1].register_forward_hook(lambda m, i, o: feats.append(o))
        model(X).pow(2).mean().backward()
        handle.remove()

    return Case(step)


def running_item() -> Case:
    model = small()
    running = 0.0

    def step() -> None:
        nonlocal running
        loss = model(X).pow(2).mean()
        loss.backward()
        running = 0.98 * running + 0.02 * loss.item()

    return Case(step)


CLEAN: dict[str, Callable[[], Case]] = {fn.__name__: fn for fn in (
    sawtooth_outputs, detached_mse_cleared, bounded_deque, exception_without_traceback,
    generator_run_to_the_end, numpy_numbers, chain_cut_every_step, hook_removed, running_item)}


# -- the truth ---------------------------------------------------------------------------------

def storage_growth(make: Callable[[], Case], *, steps: int = 8, warmup: int = 2) -> float:
    """Live storage bytes a fresh ``make()`` case keeps per step after ``warmup`` steps."""
    case = make()
    live = []
    with LiveStorages() as mode:
        for _ in range(steps):
            case.step()
            live.append(mode.live)
    return (live[-1] - live[warmup]) / (steps - 1 - warmup)
