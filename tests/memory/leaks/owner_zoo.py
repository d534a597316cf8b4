"""The memory zoo's leaks as a framework's user writes them: state kept on the model object.

A training framework owns the loop, so a leak lives on the object the user hands it: the
LightningModule (``self``) or the HF model (``model``). Each case here is a subclass of
:class:`Owner` (an ``nn.Module`` with ``self.net``) whose :meth:`Owner.grow` runs one step's
forward, leaks (or not) the way :mod:`tests.memory.leaks.memory_zoo` does, and returns the loss
for the framework to backpropagate. The same class is driven by ``dk.find_leaks`` and a
``dk.LeakDetector`` hand loop (:func:`plain_step`), and mixed into a LightningModule and an HF
model (``tests/integrations/test_leak_zoo_callbacks.py``): the line that grows it is the same in
every entry point, and the holder the same below its root name (``owner.`` / ``self.`` /
``model.``).

Usage::

    owner = OWNER_LEAKS["exception_chain"].make()
    report = dk.find_leaks(plain_step(owner))
    assert relative(report.leaks[0].holder) == OWNER_LEAKS["exception_chain"].holder
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.memory.memory_truth import LiveStorages

SOURCE = Path(__file__).read_text().splitlines()

#: the head of the linked list (TensorAttributeChain), a global as in the memory zoo
LAST_OUT: torch.Tensor | None = None
ROWS, BATCH = 64, 8


def line_of(marker: str) -> int:
    hits = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# GROW-{marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def batches() -> DataLoader[tuple[torch.Tensor, ...]]:
    """The data every entry point trains on: 8 batches of 8 rows (x: 16 wide, y: 4 wide)."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(ROWS, 16, generator=generator), torch.randn(ROWS, 4, generator=generator))
    return DataLoader(data, batch_size=BATCH)


class Owner(nn.Module):
    """What a LightningModule or an HF model is: a module with a network, and a clean step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


# -- leaks ------------------------------------------------------------------------------------

class ExceptionChain(Owner):
    def __init__(self) -> None:
        super().__init__()
        self.last_error: BaseException | None = None

    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = self.net(x)  # the traceback's frame keeps it (and its graph)
        try:
            raise RuntimeError(f"bad batch {hidden.shape}")
        except RuntimeError as e:
            e.__cause__ = self.last_error
            self.last_error = e  # GROW-owner_exception_chain
        return F.mse_loss(hidden, y)


class ClosureRunning(Owner):
    def __init__(self) -> None:
        super().__init__()
        running: Any = 0.0

        def track(loss: torch.Tensor) -> None:
            nonlocal running
            running = 0.98 * running + 0.02 * loss  # GROW-owner_closure_running

        self.track = track

    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.net(x), y)
        self.track(loss)
        return loss


class TensorAttributeChain(Owner):
    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        global LAST_OUT
        out = self.net(x)
        out.prev = LAST_OUT  # type: ignore[attr-defined]  # GROW-owner_tensor_attribute_chain
        LAST_OUT = out
        return F.mse_loss(out, y)


class SuspendedGenerators(Owner):
    def __init__(self) -> None:
        super().__init__()
        self.pending: list[Iterator[torch.Tensor]] = []

    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        def predictions() -> Iterator[torch.Tensor]:
            logits = self.net(x).detach()
            yield logits.argmax(1)
            yield logits.softmax(1)

        gen = predictions()
        next(gen)  # the rest is never asked for: the frame (and logits) stay suspended
        self.pending.append(gen)  # GROW-owner_suspended_generators
        return F.mse_loss(self.net(x), y)


class NumpyViews(Owner):
    def __init__(self) -> None:
        super().__init__()
        self.arrays: list[Any] = []

    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        self.arrays.append(out.detach().numpy())  # GROW-owner_numpy_views
        return F.mse_loss(out, y)


class CreateGraphResults(Owner):
    def __init__(self) -> None:
        super().__init__()
        self.grads: list[Any] = []

    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.net(x), y)
        grads = torch.autograd.grad(loss, list(self.net.parameters()), create_graph=True)
        self.grads.append(grads)  # GROW-owner_create_graph_results
        return F.mse_loss(self.net(x), y)


class RetainGraphChain(Owner):
    def __init__(self) -> None:
        super().__init__()
        self.delta = torch.zeros(BATCH, 16, requires_grad=True)

    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        probe = F.mse_loss(self.net(x + self.delta), y)
        probe.backward(retain_graph=True)
        self.delta = (self.delta + 0.01 * x).tanh()  # GROW-owner_retain_graph_chain
        return F.mse_loss(self.net(x), y)


class HookEveryStep(Owner):
    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        feats: list[torch.Tensor] = []
        self.net[1].register_forward_hook(lambda m, i, o: feats.append(o))  # GROW-owner_hook_every_step
        return F.mse_loss(self.net(x), y)


class DetachedMseLog(Owner):
    def __init__(self) -> None:
        super().__init__()
        self.outs: list[torch.Tensor] = []

    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.net(x), y)  # 0-d, but its storage is the 8x4 elementwise buffer (CPU)
        self.outs.append(loss.detach())  # GROW-owner_detached_mse_log
        return loss


# -- clean look-alikes -----------------------------------------------------------------------------

class SawtoothOutputs(Owner):
    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []

    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        self.outputs.append(out.detach())
        if len(self.outputs) == 3:  # used, then emptied: bounded
            self.outputs.clear()
        return F.mse_loss(out, y)


class DetachedMseCleared(Owner):
    def __init__(self) -> None:
        super().__init__()
        self.outs: list[torch.Tensor] = []

    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.net(x), y)
        self.outs.append(loss.detach())
        if len(self.outs) == 2:
            self.outs.clear()
        return loss


class BoundedDeque(Owner):
    def __init__(self) -> None:
        super().__init__()
        self.recent: collections.deque[torch.Tensor] = collections.deque(maxlen=3)

    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        self.recent.append(out.detach())
        return F.mse_loss(out, y)


class ExceptionWithoutTraceback(Owner):
    def __init__(self) -> None:
        super().__init__()
        self.last_error: BaseException | None = None

    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = self.net(x)
        try:
            raise RuntimeError(f"bad batch {hidden.shape}")
        except RuntimeError as e:
            self.last_error = e.with_traceback(None)
        return F.mse_loss(hidden, y)


class RunningItem(Owner):
    def __init__(self) -> None:
        super().__init__()
        self.running = 0.0

    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.net(x), y)
        self.running = 0.98 * self.running + 0.02 * loss.item()
        return loss


class HookRemoved(Owner):
    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        feats: list[torch.Tensor] = []
        handle = self.net[1].register_forward_hook(lambda m, i, o: feats.append(o))
        loss = F.mse_loss(self.net(x), y)
        handle.remove()
        return loss


class Spec(NamedTuple):
    make: type[Owner]
    #: the holder below its root name (``last_error`` for ``self.last_error``); None: clean
    holder: str | None = None
    kind: str | None = None
    marker: str | None = None
    minor: bool = False
    #: words the fix must contain (any one of each tuple)
    fix: tuple[tuple[str, ...], ...] = ()


OWNER_LEAKS: dict[str, Spec] = {
    "exception_chain": Spec(ExceptionChain, "last_error", "exception_frames", "owner_exception_chain",
                            fix=(("str(e)",), ("with_traceback(None)",))),
    "closure_running": Spec(ClosureRunning, "track.running", "autograd_graph", "owner_closure_running",
                            fix=((".item()",), ("running value",))),
    "tensor_attribute_chain": Spec(TensorAttributeChain, "LAST_OUT", "tensor_attributes",
                                   "owner_tensor_attribute_chain", fix=(("deque",),)),
    "suspended_generators": Spec(SuspendedGenerators, "pending", "suspended_frames", "owner_suspended_generators",
                                 fix=((".close()",),)),
    "numpy_views": Spec(NumpyViews, "arrays", "numpy_views", "owner_numpy_views", fix=((".numpy()",),)),
    "create_graph_results": Spec(CreateGraphResults, "grads", "module_cache", "owner_create_graph_results",
                                 fix=(("create_graph",), ("detach()",))),
    "retain_graph_chain": Spec(RetainGraphChain, "delta", "autograd_graph", "owner_retain_graph_chain",
                               fix=(("retain_graph",), ("detach()",))),
    "hook_every_step": Spec(HookEveryStep, "net.1._forward_hooks", "hook_per_step", "owner_hook_every_step",
                            fix=(("remove()",),)),
    "detached_mse_log": Spec(DetachedMseLog, "outs", "module_cache", "owner_detached_mse_log", minor=True,
                             fix=((".clone()", ".item()"),)),
}
OWNER_CLEAN: dict[str, Spec] = {
    "plain": Spec(Owner), "sawtooth_outputs": Spec(SawtoothOutputs), "detached_mse_cleared": Spec(DetachedMseCleared),
    "bounded_deque": Spec(BoundedDeque), "exception_without_traceback": Spec(ExceptionWithoutTraceback),
    "running_item": Spec(RunningItem), "hook_removed": Spec(HookRemoved),
}
ROOTS = ("owner", "self", "model")


def relative(holder: str) -> str:
    """The holder below the object the framework was given: ``self.last_error`` -> ``last_error``."""
    root, _, rest = holder.partition(".")
    return rest if root in ROOTS and rest else holder


def reset() -> None:
    """Forget the global linked list of an earlier run."""
    global LAST_OUT
    LAST_OUT = None


def plain_step(owner: Owner) -> Callable[[], None]:
    """One training step over :func:`batches`, as Lightning runs ``training_step`` (SGD)."""
    reset()
    opt = torch.optim.SGD(owner.parameters(), lr=0.01)
    data = iter(batches())

    def step() -> None:
        x, y = next(data)
        loss = owner.grow(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def storage_growth(spec: Spec, *, steps: int = 7, warmup: int = 2) -> float:
    """Live storage bytes a fresh owner keeps per step after ``warmup`` steps (the truth)."""
    step = plain_step(spec.make())
    live = []
    with LiveStorages() as mode:
        for _ in range(steps):
            step()
            live.append(mode.live)
    reset()
    return (live[-1] - live[warmup]) / (steps - 1 - warmup)
