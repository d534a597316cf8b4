"""Move activations to where each placed unit lives, and let parent code mix devices safely.

Two pieces make a model whose submodules sit on different devices run unchanged:

* a forward pre-hook on every unit moves its inputs (positional and keyword arguments, any
  nested structure) to the unit's device; outputs stay where they are produced, and ``.to``
  is differentiable, so autograd carries gradients back across devices;
* :class:`MixedDeviceMode`, a ``TorchFunctionMode`` active only while the parents' own code
  runs (popped off torch's mode stack while a unit runs, so units pay nothing), moves the tensor
  arguments of an op that mixes devices (``out + x`` of a skip connection, a parent's own
  positional-embedding ``nn.Parameter``, ``torch.cat`` of branches) to one device: the device of
  the tensor an in-place op writes to (``x += y``, ``x.add_(y)``, ``x[i] = y``, ``out=``), else
  the device of the unit that ran last (where the data flows). Ops on one device are untouched.

Why a mode and not a refusal: the parent's code is the user's, and the alternative (tracing it
into a graph with torch.fx) fails on data-dependent control flow that eager mode runs fine.

Usage::

    flow = DeviceFlow(torch.device("cuda:0"))
    handles = flow.attach(model.blocks[0], torch.device("cuda:0"))
    with flow:                     # the mode for the parent's code
        out = model(x)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from devicekit.modelparallel.microbatch import move

__all__ = ["DeviceFlow", "MixedDeviceMode"]

_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                               "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__",
                               "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"})


def _iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _iter_tensors(item)


def _already_on(items: Any, device: torch.device) -> bool:
    """True when ``items`` is flat (no containers) and each tensor in it is on ``device``."""
    for item in items:
        if isinstance(item, torch.Tensor):
            if item.device != device:
                return False
        elif not (item is None or isinstance(item, (bool, int, float, str))):
            return False
    return True


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The tensor an in-place op writes to, if ``func`` is one."""
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return out
    name = getattr(func, "__name__", "")
    if name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("__")):
        first = args[0] if args else None
        return first if isinstance(first, torch.Tensor) else None
    return None


class MixedDeviceMode(TorchFunctionMode):
    """Moves the tensor arguments of an op that mixes devices to one device (see module doc)."""

    def __init__(self, flow: DeviceFlow) -> None:
        super().__init__()
        self.flow = flow
        #: ops this mode has moved arguments for (a count, for the curious and the tests)
        self.moves = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.flow.depth == 0:
            first: torch.device | None = None
            mixed = False
            for t in _iter_tensors((args, kwargs)):
                if t.dim() == 0 and t.device.type == "cpu":
                    continue  # torch lets CPU scalars meet any device
                if first is None:
                    first = t.device
                elif t.device != first:
                    mixed = True
                    break
            if mixed:
                written = _written(func, args, kwargs)
                target = written.device if written is not None else self.flow.current
                args, kwargs = move((args, kwargs), target)
                self.moves += 1
        return func(*args, **kwargs)


class _ThreadState(threading.local):
    """What one thread's call of the split model is doing (a pipeline runs micro-batches in threads)."""

    def __init__(self, first: torch.device) -> None:
        self.current = first
        self.depth = 0
        self.popped = False


class DeviceFlow:
    """Per split model: the device the data is on now, and the mode parent code runs under.

    The state is per thread, so micro-batches running the model in several threads at once
    (:mod:`~devicekit.modelparallel.block_pipeline`) each keep their own."""

    def __init__(self, first: torch.device) -> None:
        self.first = first
        self._state = _ThreadState(first)
        self.mode = MixedDeviceMode(self)

    def __getstate__(self) -> dict[str, Any]:  # copy.deepcopy / pickle: a thread's state is not copied
        state = dict(self.__dict__)
        del state["_state"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._state = _ThreadState(self.first)

    @property
    def current(self) -> torch.device:
        """The device of the unit that ran last in this thread."""
        return self._state.current

    @current.setter
    def current(self, device: torch.device) -> None:
        self._state.current = device

    @property
    def depth(self) -> int:
        """Units running now in this thread (a unit called from inside another unit nests)."""
        return self._state.depth

    @depth.setter
    def depth(self, value: int) -> None:
        self._state.depth = value

    @property
    def _popped(self) -> bool:
        return self._state.popped

    @_popped.setter
    def _popped(self, value: bool) -> None:
        self._state.popped = value

    def __enter__(self) -> DeviceFlow:
        self.current, self.depth, self._popped = self.first, 0, False
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._popped:  # an error escaped a unit before its forward hook put the mode back
            torch._C._push_on_torch_function_stack(self.mode)
            self._popped = False
        self.mode.__exit__(*exc)

    def _enter_unit(self, device: torch.device) -> None:
        self.current = device
        self.depth += 1
        if self.depth == 1 and not self._popped:
            size = torch._C._len_torch_function_stack()
            if size and torch._C._get_function_stack_at(size - 1) is self.mode:
                torch._C._pop_torch_function_stack()  # units run without the mode: no per-op cost
                self._popped = True

    def _leave_unit(self) -> None:
        self.depth = max(self.depth - 1, 0)
        if self.depth == 0 and self._popped:
            torch._C._push_on_torch_function_stack(self.mode)
            self._popped = False

    def attach(self, unit: nn.Module, device: torch.device) -> list[RemovableHandle]:
        """Hooks on ``unit``: inputs to ``device`` before it runs; the mode off while it runs."""
        def pre(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
            self._enter_unit(device)
            if _already_on(args, device) and _already_on(kwargs.values(), device):
                return None  # the common case, without rebuilding the arguments
            return move(args, device), move(kwargs, device)

        def post(module: nn.Module, args: Any, output: Any) -> None:
            self._leave_unit()

        return [unit.register_forward_pre_hook(pre, with_kwargs=True),
                unit.register_forward_hook(post, always_call=True)]
