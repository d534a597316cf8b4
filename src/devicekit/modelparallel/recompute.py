"""Activation checkpointing for pipeline micro-batches: drop activations, recompute on backward.

torch's non-reentrant checkpoint scheme (saved-tensor hooks; RNG states, grad and autocast
modes preserved, so dropout draws the same mask twice), written out here because
``torch.utils.checkpoint`` imports ``torch._dynamo`` on its first call (about a second, most of
a pipeline's first training call); it also tells layers whether they are running
for the first time or being recomputed during backward: :func:`is_recomputing` lets
:class:`~devicekit.modelparallel.batchnorm.DeferredBatchNorm` count a micro-batch's statistics once.

Replay is exact only if nothing else draws from the same generator while a checkpointed part
runs its forward (two pipeline stages on the CPU, or on one GPU, share a generator):
:func:`generator_states` and :func:`drew_random_numbers` let the pipeline see whether a part
drew random numbers at all (``nn.Dropout`` or a functional ``F.dropout`` inside a custom layer
alike), and run such stages one after another.

Usage::

    from devicekit.modelparallel.recompute import checkpointed, is_recomputing

    out = checkpointed(part, x)   # like part(x), but activations are recomputed on backward
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch import fx, nn

from devicekit.errors import SplitError
from devicekit.placement.walk import map_tensors

__all__ = ["PipelineDiffers", "checkpointed", "checkpointed_call", "is_recomputing", "CHECKPOINT_MODES", "checkpoint_stop",
           "generator_states", "drew_random_numbers", "draws_random_numbers", "shares_a_generator"]

CHECKPOINT_MODES = ("never", "except_last", "always")


class PipelineDiffers(UserWarning):
    """A pipeline's result can differ from the unsplit model's on the whole batch (said once, with why)."""

_state = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed part is re-running its forward during backward (this thread)."""
    return bool(getattr(_state, "recomputing", False))


def checkpoint_stop(mode: str, microbatches: int) -> int:
    """How many leading micro-batches are checkpointed under ``mode``."""
    return {"never": 0, "except_last": max(microbatches - 1, 0), "always": microbatches}[mode]


def checkpointed(module: nn.Module, x: Any, *, name: str = "a checkpointed part") -> Any:
    """``module(x)`` without keeping its activations; they are recomputed when backward needs them.

    A part whose first layer works in place (``nn.ReLU(inplace=True)``, common in CNNs, where the
    balancer may well cut) gets a copy of its input, so the recomputation starts from the value
    the first run saw. Any other part that modifies its own input in place (``bar.add_(1)``)
    would be recomputed from the modified input, giving wrong gradients: it is refused on the
    first run, naming ``name``."""
    return checkpointed_call(module, x, name=name, copy_input=starts_in_place(module))


def checkpointed_call(fn: Callable[[Any], Any], x: Any, *, name: str, copy_input: bool = False) -> Any:
    """``fn(x)`` checkpointed as :func:`checkpointed` does a module (``x`` may be ``(args, kwargs)``)."""
    calls = 0
    # An error raised inside torch's non-reentrant checkpoint leaves its generator suspended with
    # saved-tensor hooks pushed on this thread's stack (torch 2.8-2.11); collected later in another
    # thread it pops that thread's stack: "INTERNAL ASSERT FAILED ... SavedTensorHooks.cpp" in an
    # unrelated forward. So a first-run error is kept here and raised once checkpoint returned.
    failure: list[BaseException] = []

    def body(inp: Any) -> Any:
        nonlocal calls
        previous = is_recomputing()
        first = calls == 0
        _state.recomputing = not first
        calls += 1
        versions: list[tuple[torch.Tensor, int]] = []
        if first:
            map_tensors(inp, lambda t: versions.append((t, t._version)) or t)
        try:
            # the copy is made inside the checkpointed body: the saved input stays untouched
            out = fn(map_tensors(inp, _copy) if copy_input else inp)
        except BaseException as exc:
            if not first:
                raise  # recomputation in backward: torch's own error path
            failure.append(exc)
            return None
        finally:
            _state.recomputing = previous
        changed = [t for t, v in versions if t._version != v]
        if changed:
            failure.append(SplitError(
                f"{name} modified its input in place (a {tuple(changed[0].shape)} tensor); checkpointing "
                "recomputes from that input on backward, so gradients would be wrong: avoid in-place "
                "ops on a part's input (e.g. nn.ReLU(inplace=True) first in a part) or use checkpoint='never'"
            ))
        return out

    out = _recomputed_on_backward(body, x)
    if failure:
        raise failure[0]
    return out


class _Slot:
    """Stands for one tensor the forward saved for backward; the recomputed tensor is keyed by it."""

    __slots__ = ("__weakref__",)


def _autocast_modes() -> list[tuple[str, bool, torch.dtype]]:
    kinds = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    return [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k)) for k in kinds]


def _recomputed_on_backward(fn: Callable[[Any], Any], x: Any) -> Any:
    """``fn(x)`` keeping none of the tensors autograd saves; backward recomputes them.

    torch's non-reentrant scheme (saved-tensor hooks: each saved tensor becomes a slot, the first
    unpack reruns ``fn`` with the forward's RNG states, grad and autocast modes and fills every
    slot in order), without ``torch.utils.checkpoint``, whose first call imports ``torch._dynamo``
    (about a second; most of a pipeline's first call)."""
    devices = sorted({t.device.index or 0 for t in _leaf_tensors(x) if t.is_cuda})
    cpu_state = torch.get_rng_state()
    cuda_states = [torch.cuda.get_rng_state(d) for d in devices]
    autocast = _autocast_modes()
    slots: list[weakref.ref[_Slot]] = []
    found: weakref.WeakKeyDictionary[_Slot, torch.Tensor] = weakref.WeakKeyDictionary()

    def pack(t: torch.Tensor) -> _Slot:
        slot = _Slot()
        slots.append(weakref.ref(slot))
        return slot

    def unpack(slot: _Slot) -> torch.Tensor:
        if slot not in found:
            _recompute()
        if slot not in found:
            raise SplitError("a checkpointed part's recomputation saved different tensors than its forward "
                             "(the forward depends on state that changed since): use checkpoint='never'")
        return found[slot]

    def _recompute() -> None:
        index = 0

        def refill(t: torch.Tensor) -> None:
            nonlocal index
            slot = slots[index]() if index < len(slots) else None
            index += 1
            if slot is not None:
                found[slot] = t.detach()

        def never(_: None) -> torch.Tensor:
            raise SplitError("backward reached a tensor of a checkpointed part's recomputation; "
                             "double backward through a checkpointed part is not supported: use checkpoint='never'")

        with torch.random.fork_rng(devices=devices), ExitStack() as stack:
            torch.set_rng_state(cpu_state)
            for device, state in zip(devices, cuda_states, strict=True):
                torch.cuda.set_rng_state(state, device)
            stack.enter_context(torch.enable_grad())
            for kind, enabled, dtype in autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(refill, never))
            fn(x)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return fn(x)


def _leaf_tensors(x: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(x, lambda t: found.append(t) or t)
    return found


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.is_floating_point() else t


def starts_in_place(module: nn.Module) -> bool:
    """True when ``module`` may write its own input in place: the first layer it runs (through
    nested Sequentials) has ``inplace=True``, or a traced stage (an fx ``GraphModule``, as
    :mod:`~devicekit.modelparallel.chain` makes) hands one of its inputs to such a layer, to a
    function called with ``inplace=True`` or to an in-place method (``x.relu_()``)."""
    while isinstance(module, nn.Sequential) and len(module) > 0:
        module = module[0]
    if isinstance(module, fx.GraphModule):
        inputs: set[fx.Node] = set()
        for node in module.graph.nodes:  # the placeholders and what is unpacked from them
            if node.op == "placeholder" or (node.op == "call_function" and node.target is operator.getitem
                                            and node.args[0] in inputs):
                inputs.add(node)
        return any(_writes_in_place(module, user, node) for node in inputs for user in node.users)
    return getattr(module, "inplace", False) is True


def _writes_in_place(gm: fx.GraphModule, user: fx.Node, value: fx.Node) -> bool:
    """True when node ``user`` may write ``value`` (its first argument) in place."""
    if not user.args or user.args[0] is not value:
        return False
    if user.op == "call_module":
        return starts_in_place(gm.get_submodule(str(user.target)))
    if user.op == "call_method":
        return str(user.target).endswith("_")
    if user.op == "call_function":
        return user.kwargs.get("inplace") is True or getattr(user.target, "__name__", "").endswith("_")
    return False


def generator_states(device: torch.device | None) -> list[torch.Tensor]:
    """The CPU generator's state and, for a CUDA ``device``, that device's (host-side, no sync)."""
    states = [torch.get_rng_state()]
    if device is not None and device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def drew_random_numbers(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    """True when a generator moved between two :func:`generator_states` (someone drew from it)."""
    return any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def draws_random_numbers(module: nn.Module) -> bool:
    """Layers that draw from the RNG in training: dropout (every kind), RReLU, attention dropout."""
    from torch.nn.modules.dropout import _DropoutNd

    if isinstance(module, _DropoutNd):
        return module.p > 0
    if isinstance(module, nn.MultiheadAttention):
        return module.dropout > 0
    return isinstance(module, nn.RReLU)


def shares_a_generator(devices: list[torch.device]) -> bool:
    """True when two stages draw from one generator: two CPU stages, or two on one GPU."""
    keys = [d.type if d.type == "cpu" else str(d) for d in devices]
    return len(set(keys)) < len(keys)
