"""Run a training step on fake tensors and count the bytes that would be alive at every moment.

The model is copied with its parameters and buffers replaced by fake tensors of the same
shape, dtype and stride (ties kept: two names for one parameter stay one tensor), the sample
likewise, and :func:`~devicekit.memory.step.training_step` runs under ``FakeTensorMode``;
the peak is the second step's (the steady state: optimizer state exists, and the first
step's peak is never above it), read from the first step's timeline (:mod:`.steady_state`:
what survives the first step is added where the second already holds it), which gives the
bytes of running it at half the time. A dispatch mode
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
import functools
import logging
import math
import weakref
from collections.abc import Callable, Container, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from devicekit.errors import InvalidValueError
from devicekit.memory.cpu_transients import cpu_transient_bytes
from devicekit.memory.cuda_terms import BlasWorkspaces, blas_workspaces_here
from devicekit.memory.draws import layer_kept_draw
from devicekit.memory.fake_memo import OpMemo
from devicekit.memory.layouts import pieces
from devicekit.memory.real_kernels import missing_fake_kernel, real_outputs, transient_bytes
from devicekit.memory.sparse_kernels import sparse_outputs
from devicekit.memory.steady_state import Timeline
from devicekit.memory.step import (
    LoopOutput,
    OptimizerSpec,
    StepFn,
    make_optimizer,
    tensors,
    training_step,
)
from devicekit.placement.walk import iter_tensors, map_tensors

__all__ = ["CUDA_WORKSPACES", "PARTS", "LiveBytes", "fake_step", "phase_hooks", "plain_tensor_copies",
           "resize_batch", "sample_batch"]

#: the parts of a step's memory, in the order tables show them
PARTS = ("weights", "gradients", "optimizer state", "inputs", "activations", "temporaries")
#: on CUDA, the part that holds cuBLAS's workspaces and cuDNN's transient ones (:mod:`.cuda_terms`)
CUDA_WORKSPACES = "cuda workspaces"
_CUDA_BLOCK = 512
_DEVICE_QUERY = torch.ops.prim.device.default


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every live storage, by part, and the parts at the peak.

    On CUDA (or with ``workspaces`` given) the workspaces the ops seen would allocate are a part
    of their own (:data:`CUDA_WORKSPACES`), and tensors on another device (Adam's step counts on
    the CPU) are not counted.
    """

    def __init__(self, device_type: str, *, workspaces: BlasWorkspaces | None = None) -> None:
        super().__init__()
        self.round = device_type == "cuda"
        self.device_type = device_type
        self.part = "weights"
        self.live: dict[str, int] = dict.fromkeys(PARTS, 0)
        self.workspaces = workspaces if workspaces is not None or not self.round else blas_workspaces_here()
        if self.workspaces is not None:
            self.live[CUDA_WORKSPACES] = self.workspaces.total
        self.peak = 0
        self.at_peak: dict[str, int] = dict(self.live)
        self.peak_phase = ""
        self.phase_peaks: dict[str, tuple[int, dict[str, int]]] = {}   # phase -> (peak, parts then)
        self.phase = "setup"
        self._storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.timeline: Timeline | None = None   # set: every change recorded (:mod:`.steady_state`)
        self.memo: OpMemo | None = None          # set: pure ops' outputs replayed (:mod:`.fake_memo`)

    def _size(self, storage: torch.UntypedStorage) -> int:
        size = storage.nbytes()
        return math.ceil(size / _CUDA_BLOCK) * _CUDA_BLOCK if self.round else size

    def _released(self, info: list[Any], _ref: Any) -> None:
        self.live[info[1]] -= info[0]

    def track(self, tensor: torch.Tensor, part: str | None = None) -> None:
        """Count ``tensor``'s storage (once) in ``part`` (default: the current one); retag if known."""
        if not isinstance(tensor, torch.Tensor):
            return
        if tensor.layout != torch.strided or tensor.is_quantized:   # sparse, nested: their pieces
            for piece in pieces(tensor):
                if piece is not tensor:
                    self.track(piece, part)
            if tensor.layout != torch.strided:
                return
        if self.round and tensor.device.type != self.device_type:   # not in this GPU's memory
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
        if self.timeline is not None:
            self.timeline.born(storage, info)
        self.live[info[1]] += info[0]
        self.note_peak()

    def restart_peak(self) -> None:
        """Forget the peak so far (after the first step: the steady state is what counts)."""
        self.peak, self.at_peak, self.peak_phase = 0, dict(self.live), ""
        self.phase_peaks = {}
        self.note_peak()

    def note_peak(self, transient: int = 0) -> None:
        """Note the live total (plus ``transient`` workspace bytes an op holds while it runs)."""
        if self.timeline is not None:
            self.timeline.note(self.live, transient, self.phase)
        total = sum(self.live.values()) + transient
        if total <= self.peak and total <= self.phase_peaks.get(self.phase, (-1,))[0]:
            return
        parts = dict(self.live)
        if transient:
            held = CUDA_WORKSPACES if self.workspaces is not None else "temporaries"
            parts[held] = parts.get(held, 0) + transient
        if total > self.peak:
            self.peak = total
            self.at_peak = parts
            self.peak_phase = self.phase
        if total > self.phase_peaks.get(self.phase, (-1,))[0]:
            self.phase_peaks[self.phase] = (total, dict(parts))

    def _cuda_terms(self, func: Any, args: Any) -> None:
        """The workspaces ``func`` allocates: cuBLAS's for good, cuDNN's while it runs."""
        assert self.workspaces is not None
        backward = torch._C._current_autograd_node() is not None   # autograd's own thread on CUDA
        added = self.workspaces.added(func.name(), backward=backward)
        if added:
            self.live[CUDA_WORKSPACES] += added
            self.note_peak()
        transient = transient_bytes(func, args)
        if transient:
            self.note_peak(transient)

    def _track_outputs(self, out: Any) -> None:
        """Track every tensor an op returned (a tensor, or a tuple / list of them: an aten op's
        outputs; a plain loop, as pytree's walk cost a third of a fake step's time)."""
        if isinstance(out, torch.Tensor):
            self.track(out)
        elif isinstance(out, (tuple, list)):
            for item in out:
                if isinstance(item, (torch.Tensor, tuple, list)):
                    self._track_outputs(item)

    def _dispatch(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if self.memo is None:
            return func(*args, **kwargs)
        out = self.memo.replay(func, args, kwargs)
        if out is OpMemo.MISS:
            out = func(*args, **kwargs)
            self.memo.remember(func, args, kwargs, out)
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _DEVICE_QUERY and type(args[0]) is FakeTensor and not args[0].fake_mode.in_kernel_invocation:
            return args[0].fake_device   # ``x.device``, answered as FakeTensor would: RNNs ask each step
        if func in _SAME_DTYPE_OPS:
            _check_same_dtype(func, args)
        kwargs = kwargs or {}
        out = layer_kept_draw(func, args, kwargs)   # LayerDrop: the step where every layer runs
        if out is None:
            out = missing_fake_kernel(func, args)   # cuDNN's RNN backward: no fake kernel in torch
        out = real_outputs(func, args, self._dispatch(func, args, kwargs) if out is None else out)
        out = sparse_outputs(func, args, out)
        self._track_outputs(out)
        if self.workspaces is not None:
            self._cuda_terms(func, args)
        elif self.device_type == "cpu":
            transient = cpu_transient_bytes(func, args, out)   # oneDNN's reorders (:mod:`.cpu_transients`)
            if transient:
                self.note_peak(transient)
        return out


#: matrix products whose real kernels refuse operands of different dtypes, and whose fake
#: kernels do not (a long sample fed to a Linear was sized, not refused)
_SAME_DTYPE_OPS = frozenset(getattr(torch.ops.aten, name).default for name in
                            ("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot"))


def _check_same_dtype(func: Any, args: Any) -> None:
    dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor)}
    if len(dtypes) > 1:
        raise RuntimeError(f"{func.name()}: the operands must have the same dtype, got "
                           f"{' and '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))}")


def sample_batch(sample: Any) -> int | None:
    """The batch of ``sample``: the first dimension of its first tensor that has one."""
    first = next((t for t in tensors(sample) if t.dim() > 0), None)   # in order (iter_tensors is not)
    return int(first.shape[0]) if first is not None else None


def resize_batch(sample: Any, batch_size: int | None) -> Any:
    """``sample`` as shapes only, with the batch dimension set to ``batch_size``: the first
    dimension of each tensor whose first dimension is the sample's batch (a tensor of another
    length, e.g. a retrieval bank or class weights beside the batch, keeps its shape)."""
    batch = sample_batch(sample)

    def shape_of(t: torch.Tensor) -> torch.Tensor:
        shape = list(t.shape)
        if batch_size is not None and shape and shape[0] == batch:
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
    # weights and buffers keep their fake copies: an RNN also lists its weights in an attribute
    # (``_flat_weights``), which must stay the parameters, or they get no gradient
    memo.update(plain_tensor_copies(model, lambda t: _fake_like(t, t.device), known=memo))
    return copy.deepcopy(model, memo)


def plain_tensor_copies(model: nn.Module, make: Callable[[torch.Tensor], Any], *,
                        graph_only: bool = False, known: Container[int] = ()) -> dict[int, Any]:
    """``deepcopy`` memo entries for the tensors a module keeps beside its weights and buffers.

    Such a tensor (a recurrent state or cache the last forward left in an attribute:
    RecurrentGemma's ``recurrent_states``) cannot be deep-copied under fake tensors at all (its
    real storage cannot back a fake tensor), nor anywhere once autograd made it (not a graph
    leaf), so no copy of such a model could be made once it had run: ``make(detached)`` stands
    in for each (``graph_only``: only for those autograd made; ``known``: ids that have their
    copy already, the weights: no second copy is made, which under the estimate's tracker would
    count until the garbage collector freed it)."""
    skip = ("_parameters", "_buffers", "_modules")
    memo: dict[int, Any] = {}

    def visit(value: Any, depth: int) -> None:  # tensors, and lists / dicts of them: not configs
        if isinstance(value, torch.Tensor):
            if not (graph_only and value.is_leaf) and id(value) not in memo and id(value) not in known:
                memo[id(value)] = make(value.detach())
        elif depth < 3 and isinstance(value, (list, tuple, dict)):
            for item in value.values() if isinstance(value, dict) else value:
                visit(item, depth + 1)

    for module in model.modules():
        for key, value in vars(module).items():
            if key not in skip:
                visit(value, 0)
    return memo

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
    read_second: bool = True,
) -> tuple[int, dict[str, int], str]:
    """(peak bytes, parts at the peak, phase of the peak) of ``steps`` steps on fake tensors.

    ``sample`` holds tensors of any device (meta is fine); only shapes and dtypes are used.
    ``keep_output`` / ``step``: see :func:`~devicekit.memory.step.training_step`; what a step
    keeps stays alive as in a loop (:class:`LoopOutput`): the output until the next step's
    forward returns, a ``step``'s return value until the next step returns. So with
    ``training=False`` too: an eval loop's ``out = model(x)`` holds the last output through the
    next forward.
    ``read_second``: the second step's peak is read from the first step's timeline
    (:mod:`.steady_state`: half the time); False runs it.
    """
    tracker = LiveBytes(device.type)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracker.memo = OpMemo(fake_mode)
    with _quiet_fake_tensor_log(), fake_mode, tracker:
        fake = _fake_model(model, device, tracker)
        fake.train(training)
        batch = map_tensors(sample, lambda t: _fake_like(t, device))
        for t in _flat(batch):
            tracker.track(t, "inputs")
        opt = make_optimizer(optimizer, fake.parameters(), foreach=device.type == "cuda") if training else None
        hooks = phase_hooks(fake, opt, tracker)
        # the previous output dies when the next forward returns; a step='s return value when
        # the next step returns (``out = step(model, x)``)
        last = LoopOutput(fake, until_forward=step is None)
        timeline = None
        if steps == 2 and read_second:  # the second step read from the first (:mod:`.steady_state`)
            tracker.phase, tracker.part = "after step", "temporaries"
            timeline = tracker.timeline = Timeline(PARTS)
            tracker.note_peak()
            if step is None:  # a step='s return value lives to the step's end (the default)
                hooks.append(fake.register_forward_hook(lambda *_: timeline.forward_returned()))
        try:
            for index in range(1 if timeline is not None else steps):
                if index == 1:  # gradients and optimizer state now exist: measure the steady state
                    tracker.restart_peak()
                last.keep(training_step(fake, batch, opt, precision=precision, loss_fn=loss_fn,
                                        training=training, device_type=device.type,
                                        keep_output=keep_output, step=step))
                tracker.phase, tracker.part = "after step", "temporaries"
            if training and step is not None and not any(p.grad is not None for p in fake.parameters()):
                raise InvalidValueError(
                    f"your step {getattr(step, '__name__', 'fn')} made no gradients: it runs the "
                    "forward and the loss, and must call loss.backward() too (devicekit adds the "
                    "optimizer step); for a forward only, pass training=False")
            if timeline is not None:
                result = timeline.second_step(functools.partial(_drop_grads, fake), lambda: last.keep(None))
        finally:
            last.close()
            for handle in hooks:
                handle.remove()
        if timeline is None:
            result = (tracker.peak, dict(tracker.at_peak), tracker.peak_phase)
        tracker.timeline = None
        del fake, batch, opt
    return result


def _drop_grads(model: nn.Module) -> None:
    """What the next step's ``zero_grad(set_to_none=True)`` frees first."""
    for p in model.parameters():
        p.grad = None


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
        # state an optimizer makes when it is built (Adagrad's sums) is its state, not weights
        step_ends(opt, (), {})
        handles.append(opt.register_step_pre_hook(step_starts))
        handles.append(opt.register_step_post_hook(step_ends))
    return handles
