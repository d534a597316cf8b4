"""Trace a module's forward with ``torch.fx``, keeping what the plain tracer loses.

``torch.fx.symbolic_trace`` runs the forward on proxies and records the ops, but a
``with torch.no_grad():`` block (or ``enable_grad``, ``set_grad_enabled``, a ``@torch.no_grad()``
method) only changes the grad mode while tracing: the graph runs it with grad, so a stop-gradient
branch (a target network) would get gradients. Here grad-mode changes are recorded as graph
nodes: ``prev = grad_mode_enter(False)`` where the block starts and ``grad_mode_restore(prev)``
where it ends, so the traced graph (and every stage cut from it) switches the mode where the
model does. ``torch.inference_mode`` and a ``torch.set_grad_enabled(False)`` that is never
undone in the forward are refused by name.

Arguments after the first are specialised to their defaults (a pipeline feeds one batch): the
tracer's extra placeholders and their assertions are removed, so the graph takes the batch only.
A forward that does not trace is refused with the tracer's reason.

Usage::

    from devicekit.modelparallel.trace import trace_module

    gm = trace_module(model, leaves={"blocks.0", "head"})   # an fx.GraphModule taking one batch
    gm(x)                                                   # == model(x), grad modes included
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.autograd import grad_mode
from torch.fx._symbolic_trace import _assert_is_none

from devicekit.errors import InvalidValueError, SplitError
from devicekit.modelparallel.state_guard import StateGuard

__all__ = ["trace_module", "grad_mode_enter", "grad_mode_restore", "grad_regions", "UntraceableError"]


class UntraceableError(SplitError):
    """The forward is not a one-batch chain ``torch.fx`` can follow (a pipeline then runs it by hooks)."""


def grad_mode_enter(mode: bool | None) -> bool:
    """Set grad mode to ``mode`` (None: leave it) and return the mode it replaced."""
    prev = torch.is_grad_enabled()
    if mode is not None and mode != prev:
        torch._C._set_grad_enabled(mode)
    return prev


def grad_mode_restore(prev: bool) -> None:
    """Put back the grad mode :func:`grad_mode_enter` returned."""
    if torch.is_grad_enabled() != prev:
        torch._C._set_grad_enabled(prev)


class _Tracer(fx.Tracer):
    def __init__(self, leaves: set[str] | None, opened: set[str]) -> None:
        super().__init__()
        self.leaves, self.opened = leaves, opened
        # ``self.steps.add_(1)`` on a buffer: recorded, not run once at trace time and dropped
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.opened:
            return False
        if self.leaves is None or module_qualified_name in self.leaves:
            return True
        return super().is_leaf_module(m, module_qualified_name)


@contextlib.contextmanager
def _flag(flags: list[bool], on: bool) -> Iterator[None]:
    if on:
        flags.append(True)
    try:
        yield
    finally:
        if on:
            flags.pop()


# factories whose sizes or device may come from the batch (``torch.ones(t, t, device=x.device)``)
_FACTORIES = ("ones", "zeros", "full", "empty", "arange", "eye", "linspace", "rand", "randn", "randint",
              "ones_like", "zeros_like", "full_like", "empty_like")


@contextlib.contextmanager
def _recording_factories(tracer: fx.Tracer) -> Iterator[None]:
    """While tracing (in this thread), ``torch.ones(t, t)`` with a traced size becomes a graph node."""
    me = threading.get_ident()
    saved = {name: getattr(torch, name) for name in _FACTORIES}

    def recorded(original: Any) -> Any:
        def factory(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == me:
                found: list[bool] = []
                fx.node.map_aggregate((args, kwargs), lambda a: found.append(isinstance(a, fx.Proxy)))
                if any(found):
                    return tracer.create_proxy("call_function", original, args, kwargs)
            return original(*args, **kwargs)
        return factory

    try:
        for name, original in saved.items():
            setattr(torch, name, recorded(original))
        yield
    finally:
        for name, original in saved.items():
            setattr(torch, name, original)


@contextlib.contextmanager
def _recording_grad_modes(tracer: fx.Tracer, name: str) -> Iterator[list[Any]]:
    """While tracing (in this thread), grad-mode context managers also add graph nodes."""
    me = threading.get_ident()
    opened: list[Any] = []  # set_grad_enabled calls not yet undone
    inside: list[bool] = []  # in no_grad/enable_grad's own methods (which call set_grad_enabled)
    saved = {(cls, attr): cls.__dict__[attr] for cls, attr in [
        (grad_mode.no_grad, "__enter__"), (grad_mode.no_grad, "__exit__"),
        (grad_mode.enable_grad, "__enter__"), (grad_mode.enable_grad, "__exit__"),
        (grad_mode.set_grad_enabled, "__init__"), (grad_mode.set_grad_enabled, "__exit__"),
        (grad_mode.inference_mode, "__enter__")]}

    def enter_for(mode: bool, original: Any) -> Any:
        def __enter__(self: Any) -> None:
            with _flag(inside, threading.get_ident() == me):
                original(self)
            if threading.get_ident() == me:
                self._devicekit_prev = tracer.create_proxy("call_function", grad_mode_enter, (mode,), {})
        return __enter__

    def exit_for(original: Any) -> Any:
        def __exit__(self: Any, *exc: Any) -> None:
            with _flag(inside, threading.get_ident() == me):
                original(self, *exc)
            prev = self.__dict__.pop("_devicekit_prev", None)
            if threading.get_ident() == me and prev is not None:
                tracer.create_proxy("call_function", grad_mode_restore, (prev,), {})
                if self in opened:
                    opened.remove(self)
        return __exit__

    def set_init(self: Any, mode: bool) -> None:
        if threading.get_ident() == me and not inside:
            if isinstance(mode, fx.Proxy):
                raise SplitError(f"cannot pipeline {name}: its forward sets the grad mode from a traced "
                                 "value (torch.set_grad_enabled(<tensor>)); use a Python bool")
            self._devicekit_prev = tracer.create_proxy("call_function", grad_mode_enter, (bool(mode),), {})
            opened.append(self)
        saved[(grad_mode.set_grad_enabled, "__init__")](self, mode)

    def inference_enter(self: Any) -> None:
        if threading.get_ident() == me and getattr(self, "mode", True):
            raise SplitError(f"cannot pipeline {name}: its forward enters torch.inference_mode, which a "
                             "pipeline cannot cut through; use torch.no_grad() there, or dk.split(model, devices)")
        saved[(grad_mode.inference_mode, "__enter__")](self)

    patches = {
        (grad_mode.no_grad, "__enter__"): enter_for(False, saved[(grad_mode.no_grad, "__enter__")]),
        (grad_mode.no_grad, "__exit__"): exit_for(saved[(grad_mode.no_grad, "__exit__")]),
        (grad_mode.enable_grad, "__enter__"): enter_for(True, saved[(grad_mode.enable_grad, "__enter__")]),
        (grad_mode.enable_grad, "__exit__"): exit_for(saved[(grad_mode.enable_grad, "__exit__")]),
        (grad_mode.set_grad_enabled, "__init__"): set_init,
        (grad_mode.set_grad_enabled, "__exit__"): exit_for(saved[(grad_mode.set_grad_enabled, "__exit__")]),
        (grad_mode.inference_mode, "__enter__"): inference_enter,
    }
    prev_mode = torch.is_grad_enabled()
    try:
        for (cls, attr), fn in patches.items():
            setattr(cls, attr, fn)
        yield opened
    finally:
        for (cls, attr), fn in saved.items():
            setattr(cls, attr, fn)
        torch._C._set_grad_enabled(prev_mode)  # a refused trace may have left a block open


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 140 else text[:137] + "..."


def _in_words(error: BaseException) -> str:
    """What in the model's forward the tracer could not follow, in words rather than its internals."""
    text = str(error)
    if "control flow" in text or "iteration" in text or "len(" in text:
        return "Python control flow on a tensor's value (an if, a loop or len() on a tensor)"
    if "co_varnames" in text or "positional" in text or "argument" in text:
        return "its arguments (keyword-only, *args or **kwargs)"
    return f"its code ({_short(error)})"


def _concrete_args(model: nn.Module) -> dict[str, Any]:
    """Defaults of the forward's parameters after the first: a pipeline feeds one batch."""
    params = list(inspect.signature(model.forward).parameters.values())
    name = type(model).__name__
    if not params:
        raise SplitError(f"cannot pipeline {name}: its forward takes no input; a pipeline feeds it one batch")
    concrete: dict[str, Any] = {}
    for p in params[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is inspect.Parameter.empty:
            raise UntraceableError(
                f"cannot pipeline {name}: its forward needs argument {p.name!r} besides the batch; a pipeline "
                "feeds one batch: take a tuple or dict as the first argument, or use dk.split(model, devices)")
        concrete[p.name] = p.default
    return concrete


def _drop_specialised(graph: fx.Graph, name: str) -> None:
    """Remove the placeholders of defaulted arguments and the tracer's checks of their values.

    The tracer used the default values themselves; a placeholder only feeds those checks."""
    checks = {operator.eq, torch._assert, _assert_is_none}
    for node in [n for n in graph.nodes if n.op == "placeholder"][1:]:
        users: list[fx.Node] = []
        todo = list(node.users)
        while todo:
            user = todo.pop()
            if user.op != "call_function" or user.target not in checks:
                raise UntraceableError(f"cannot pipeline {name}: its argument {node.target!r} is used as a value; "
                                 "a pipeline feeds one batch: pass it inside the batch")
            users.append(user)
            todo.extend(user.users)
        for user in sorted(set(users), key=lambda u: -_position(graph, u)):
            graph.erase_node(user)
        graph.erase_node(node)


def _position(graph: fx.Graph, node: fx.Node) -> int:
    return next(i for i, n in enumerate(graph.nodes) if n is node)


def trace_module(model: nn.Module, leaves: set[str] | None = None, opened: set[str] | None = None) -> fx.GraphModule:
    """``model``'s forward as an ``fx.GraphModule`` of one input, grad-mode blocks recorded.

    ``leaves``: qualified names of submodules kept whole (None: every submodule);
    ``opened``: names traced through even when ``leaves`` is None."""
    name = type(model).__name__
    concrete = _concrete_args(model)
    tracer = _Tracer(leaves, opened or set())
    try:
        with StateGuard(model), _recording_factories(tracer), _recording_grad_modes(tracer, name) as still_open:
            graph = tracer.trace(model, concrete_args=concrete or None)
            if still_open:
                raise SplitError(f"cannot pipeline {name}: its forward calls torch.set_grad_enabled(...) without "
                                 "undoing it; use it as a context manager (with torch.set_grad_enabled(...):)")
    except (SplitError, InvalidValueError):
        raise
    except Exception as e:  # the tracer's reason, whatever raised it, in the model's words
        raise UntraceableError(
            f"cannot pipeline {name}: its forward does not trace into a chain of stages (torch.fx cannot "
            f"follow {_in_words(e)}); pass stages=[...] naming submodules to cut before (control flow "
            "inside them is fine), or use dk.split(model, devices), which runs any forward") from None
    _drop_specialised(graph, name)
    graph.lint()
    return fx.GraphModule(model, graph, class_name=name)


def grad_regions(nodes: list[fx.Node]) -> list[list[bool]]:
    """Per position ``i`` (0..len(nodes)), the grad modes of the blocks open before node ``i``."""
    stack: list[tuple[fx.Node, bool]] = []
    states = [[]]
    for n in nodes:
        if n.op == "call_function" and n.target is grad_mode_enter:
            stack.append((n, bool(n.args[0])))
        elif n.op == "call_function" and n.target is grad_mode_restore:
            opener = n.args[0]
            while stack and stack[-1][0] is not opener:
                stack.pop()
            if stack:
                stack.pop()
        states.append([mode for _, mode in stack])
    return states
