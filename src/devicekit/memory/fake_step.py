"""Run a training step on fake tensors and count the bytes that would be alive at every moment.

The model is copied with its parameters and buffers replaced by fake tensors of the same
shape, dtype and stride (ties kept: two names for one parameter stay one tensor), the sample
likewise, and :func:`~devicekit.memory.step.training_step` runs twice under ``FakeTensorMode``;
the peak is the second step's (the steady state: optimizer state exists, and the first
step's peak is never above it). A dispatch mode
sees every tensor the real forward, backward and optimizer step create, and a weak reference
to each storage tells when it dies, so the live total, and its peak, is what the caching
allocator would have handed out (on CUDA rounded up to its 512-byte blocks). No real memory
for the model or its activations is allocated, so a model bigger than this machine is sized.

Each live storage belongs to one part: weights, inputs, activations (made in the forward),
temporaries (made in the backward and the optimizer step), gradients, optimizer state. The
parts at the moment of the peak add up to the peak.

Usage::

    from devicekit.memory.fake_step import fake_step

    peak, parts, phase = fake_step(model, sample, optimizer="adam", device=torch.device("cpu"))
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from devicekit.memory.real_kernels import real_outputs
from devicekit.memory.step import LoopOutput, OptimizerSpec, StepFn, make_optimizer, training_step
from devicekit.placement.walk import iter_tensors, map_tensors

__all__ = ["PARTS", "LiveBytes", "fake_step", "phase_hooks", "resize_batch"]

#: the parts of a step's memory, in the order tables show them
PARTS = ("weights", "gradients", "optimizer state", "inputs", "activations", "temporaries")
_CUDA_BLOCK = 512


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every live storage, by part, and the parts at the peak."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.round = device_type == "cuda"
        self.part = "weights"
        self.live: dict[str, int] = dict.fromkeys(PARTS, 0)
        self.peak = 0
        self.at_peak: dict[str, int] = dict(self.live)
        self.peak_phase = ""
        self.phase_peaks: dict[str, tuple[int, dict[str, int]]] = {}   # phase -> (peak, parts then)
        self.phase = "setup"
        self._storages: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _size(self, storage: torch.UntypedStorage) -> int:
        size = storage.nbytes()
        return math.ceil(size / _CUDA_BLOCK) * _CUDA_BLOCK if self.round else size

    def _released(self, info: list[Any], _ref: Any) -> None:
        self.live[info[1]] -= info[0]

    def track(self, tensor: torch.Tensor, part: str | None = None) -> None:
        """Count ``tensor``'s storage (once) in ``part`` (default: the current one); retag if known."""
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            return
        storage = tensor.untyped_storage()
        known = self._storages.get(storage)
        if known is not None:
            if part is not None and known[0][1] != part:  # retag: a grad, optimizer state, input
                self.live[known[0][1]] -= known[0][0]
                known[0][1] = part
                self.live[part] += known[0][0]
            return
        info = [self._size(storage), part or self.part]
        self._storages[storage] = (info, weakref.ref(storage, lambda ref, i=info: self._released(i, ref)))
        self.live[info[1]] += info[0]
        self.note_peak()

    def restart_peak(self) -> None:
        """Forget the peak so far (after the first step: the steady state is what counts)."""
        self.peak, self.at_peak, self.peak_phase = 0, dict(self.live), ""
        self.phase_peaks = {}
        self.note_peak()

    def note_peak(self) -> None:
        total = sum(self.live.values())
        if total > self.peak:
            self.peak = total
            self.at_peak = dict(self.live)
            self.peak_phase = self.phase
        if total > self.phase_peaks.get(self.phase, (-1,))[0]:
            self.phase_peaks[self.phase] = (total, dict(self.live))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = real_outputs(func, args, func(*args, **(kwargs or {})))
        tree_map_only(torch.Tensor, self.track, out)
        return out


def resize_batch(sample: Any, batch_size: int | None) -> Any:
    """``sample`` as shapes only, with the first dimension of every tensor set to ``batch_size``."""
    def shape_of(t: torch.Tensor) -> torch.Tensor:
        shape = list(t.shape)
        if batch_size is not None and shape:
            shape[0] = batch_size
        return torch.empty(shape, dtype=t.dtype, device="meta")

    return map_tensors(sample, shape_of)



def _fake_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


def _fake_model(model: nn.Module, device: torch.device, tracker: LiveBytes) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake (ties kept), counted as weights."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        fake = nn.Parameter(_fake_like(p, device), requires_grad=p.requires_grad)
        tracker.track(fake, "weights")
        memo[id(p)] = fake
    for b in model.buffers():
        fake_b = _fake_like(b, device)
        tracker.track(fake_b, "weights")
        memo[id(b)] = fake_b
    return copy.deepcopy(model, memo)


def fake_step(
    model: nn.Module,
    sample: Any,
    *,
    optimizer: OptimizerSpec = "adam",
    precision: str | torch.dtype | None = None,
    training: bool = True,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    device: torch.device,
    steps: int = 2,
    keep_output: bool = False,
    step: StepFn | None = None,
) -> tuple[int, dict[str, int], str]:
    """(peak bytes, parts at the peak, phase of the peak) of ``steps`` steps on fake tensors.

    ``sample`` holds tensors of any device (meta is fine); only shapes and dtypes are used.
    ``keep_output`` / ``step``: see :func:`~devicekit.memory.step.training_step`; what a step
    keeps stays alive until the next step's forward returns, as in a loop (:class:`LoopOutput`).
    """
    tracker = LiveBytes(device.type)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with _quiet_fake_tensor_log(), fake_mode, tracker:
        fake = _fake_model(model, device, tracker)
        fake.train(training)
        batch = map_tensors(sample, lambda t: _fake_like(t, device))
        for t in _flat(batch):
            tracker.track(t, "inputs")
        opt = make_optimizer(optimizer, fake.parameters(), foreach=device.type == "cuda") if training else None
        hooks = phase_hooks(fake, opt, tracker)
        last = LoopOutput(fake)  # the previous output dies when the next forward returns
        try:
            for index in range(steps if training else 1):
                if index == 1:  # gradients and optimizer state now exist: measure the steady state
                    tracker.restart_peak()
                last.keep(training_step(fake, batch, opt, precision=precision, loss_fn=loss_fn,
                                        training=training, device_type=device.type,
                                        keep_output=keep_output, step=step))
                tracker.phase, tracker.part = "after step", "temporaries"
        finally:
            last.close()
            for handle in hooks:
                handle.remove()
        result = (tracker.peak, dict(tracker.at_peak), tracker.peak_phase)
        del fake, batch, opt
    return result


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """Keep torch's fake-tensor logger quiet while a step runs on fake tensors.

    From torch 2.15 a failing meta kernel (a model that does not accept the sample) is logged
    with its whole traceback on stderr before the error is raised; the caller turns the error
    into one line, so the log only buries it.
    """
    logger = logging.getLogger(FakeTensorMode.__module__)
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


def _flat(obj: Any) -> list[torch.Tensor]:
    return list(iter_tensors(obj))


def phase_hooks(model: nn.Module, opt: torch.optim.Optimizer | None, tracker: LiveBytes) -> list[Any]:
    """Hooks that tell the tracker which part new tensors belong to, and retag grads and state."""
    def forward_starts(module: nn.Module, args: Any) -> None:
        tracker.phase, tracker.part = "forward", "activations"

    def forward_ends(module: nn.Module, args: Any, out: Any) -> None:
        tracker.phase, tracker.part = "backward", "temporaries"

    def grad_ready(p: torch.Tensor) -> None:
        if p.grad is not None:
            tracker.track(p.grad, "gradients")

    def step_starts(optimizer: Any, args: Any, kwargs: Any) -> None:
        tracker.phase, tracker.part = "optimizer step", "temporaries"

    def step_ends(optimizer: Any, args: Any, kwargs: Any) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    tracker.track(value, "optimizer state")

    handles = [model.register_forward_pre_hook(forward_starts),
               model.register_forward_hook(forward_ends)]
    for p in model.parameters():
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(grad_ready))
    if opt is not None:
        handles.append(opt.register_step_pre_hook(step_starts))
        handles.append(opt.register_step_post_hook(step_ends))
    return handles
