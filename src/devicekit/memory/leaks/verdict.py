"""From measured series to leaks: the kind of each growing holder and the fix that fits it.

``pattern_of`` names the patterns a holder's path shows: a hook dict, ``param_groups``,
``_buffers``, an ``lru_cache``, a class attribute, lambdas' default arguments, exceptions'
frames, suspended generators, tensors linked through their attributes, numpy arrays sharing
torch storage. ``kind_of`` falls back to what the measurement says. ``fix_for`` picks the advice
from the kind, the measurement (is the graph still saved, was part of it backpropagated) and
what the code does (``flags`` from :mod:`~devicekit.memory.leaks.hints`: ``retain_graph``,
``create_graph``, a running value, an exception chain).

Usage::

    from devicekit.memory.leaks.verdict import kind_of, fix_for, pattern_of

    kind = kind_of(in_module=False, is_tensor=True, nodes_grow=True)   # "autograd_graph"
    fix_for(kind, "total_loss", graph_alive=False, has_graph=True)
    pattern_of("model.1._forward_hooks", via="[3].<closure feats>[0]", origin="local",
               is_lru=False)                                            # "hook_per_step"
"""

from __future__ import annotations

import re
from collections.abc import Collection

from devicekit.memory.leaks.reach import HOOK_DICTS

__all__ = ["kind_of", "fix_for", "pattern_of", "detail_of", "via_of"]

#: THROUGH bit -> path-like text (see devicekit.memory.leaks.measure.THROUGH)
_VIA = ((8, ".__defaults__"), (1, ".<closure>"), (2, ".__traceback__"), (128, ".__cause__"),
        (32, ".gi_frame"), (64, ".base"), (16, ".<tensor attribute>"))


def via_of(through: int) -> str:
    """A path-like text for measured ``THROUGH`` flags (holders named up front have no path)."""
    return "".join(text for bit, text in _VIA if through & bit)


def pattern_of(holder: str, *, via: str, origin: str, is_lru: bool) -> str | None:
    """The leak pattern a holder's path shows, or None when the measurement must say."""
    last = holder.rsplit(".", 1)[-1]
    if is_lru:
        return "lru_cache"
    if last in HOOK_DICTS:
        return "hook_per_step"
    if last == "param_groups":
        return "param_groups"
    if last == "_buffers":
        return "buffer_per_step"
    if last == "__dict__":
        return "attr_per_step"
    if last == "_modules":
        return "module_per_step"
    if ".__traceback__" in via or ".tb_frame" in via:
        return "exception_frames"
    if ".gi_frame" in via:
        return "suspended_frames"
    if ".base" in via:
        return "numpy_views"
    if ".<tensor attribute>" in via:
        return "tensor_attributes"
    if ".__defaults__" in via or ".__kwdefaults__" in via or ".<closure" in via:
        return "deferred_closure"
    if origin == "class":
        return "class_attribute"
    return None


def detail_of(kind: str, *, via: str, where: str, flags: Collection[str] = ()) -> str:
    """The short note printed after the holder: how the pattern holds the memory."""
    if kind == "hook_per_step":
        return f"a hook registered at {where} every step" if where else "a hook registered every step"
    if kind == "lru_cache":
        return "lru_cache"
    if kind == "deferred_closure":
        return "a lambda's default argument" if "__defaults__" in via else "a function's closure variable"
    if kind == "exception_frames":
        if ".__cause__" in via or "cause_chain" in flags:
            return "each exception chained to the last, each traceback keeping its frames' locals"
        return "exceptions keep their traceback frames' locals"
    if kind == "suspended_frames":
        return "each suspended generator keeps its frame's locals"
    if kind == "numpy_views":
        return "`.numpy()` arrays share, and keep alive, their tensor's storage"
    if kind == "tensor_attributes":
        return "each tensor keeps the last one in an attribute"
    if kind == "param_groups":
        return "a param group added every step"
    if kind == "buffer_per_step":
        return "a buffer registered every step"
    if kind == "attr_per_step":
        return "a new attribute every step"
    if kind == "module_per_step":
        return "a submodule added every step"
    if kind == "class_attribute":
        return "a class attribute, shared by every instance"
    if "create_graph" in flags:
        return "results of autograd.grad(create_graph=True)"
    return ""


def kind_of(*, in_module: bool, is_tensor: bool, nodes_grow: bool) -> str:
    if is_tensor and nodes_grow:  # one tensor whose graph grows: on a module (`self.delta`) too
        return "autograd_graph"
    if in_module:
        return "module_cache"
    if is_tensor:
        return "autograd_graph" if nodes_grow else "growing_tensor"
    return "growing_container"


def fix_for(kind: str, holder: str, *, graph_alive: bool, has_graph: bool, graph_freed: bool = False,
            flags: Collection[str] = (), through: int = 0, line: str = "") -> str:
    """One line of advice for ``holder`` leaking as ``kind``; ``flags``: what the code does
    (:mod:`~devicekit.memory.leaks.hints`), ``line``: the line that extended it."""
    graph = " and its autograd graph" if has_graph else ""
    special = _fix_from_code(kind, holder, graph_alive=graph_alive, has_graph=has_graph,
                             graph_freed=graph_freed, flags=flags, line=line)
    if special:
        return special
    if kind == "hook_per_step":
        owner = re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", holder.rsplit(".", 1)[0])  # model.1 -> model[1]
        return (f"a hook is registered on `{owner}` every step and never removed, and each keeps what "
                f"it captured: register it once before the loop, or keep the handle "
                f"(`h = {owner}.register_forward_hook(...)`) and call `h.remove()` after the step")
    if kind == "lru_cache":
        return (f"`{holder}` (lru_cache) keeps every result tensor{graph} for every new argument: do not "
                f"cache tensors per step, or cache `.detach()`ed results under a bounded key with a small "
                f"`lru_cache(maxsize=...)`")
    if kind == "deferred_closure":
        return (f"each function in `{holder}` keeps its step's tensor{graph}: capture `x.item()` or "
                f"`x.detach()` instead, and run and clear `{holder}` every step")
    if kind == "exception_frames":
        if through & 128 or "cause_chain" in flags:
            return (f"`{holder}` links each step's exception to the last (`e.__cause__ = ...`), and every "
                    f"traceback keeps its frames' locals (tensors included): keep `str(e)`, or "
                    f"`e.with_traceback(None)` without the chain, and do not link exceptions across steps")
        return (f"`{holder}` keeps exceptions, whose tracebacks keep every frame's locals (tensors "
                f"included): keep `str(e)` or `traceback.format_exc()`, or `e.with_traceback(None)`")
    if kind == "suspended_frames":
        return (f"`{holder}` keeps suspended generators (or coroutines), and each keeps its frame's locals "
                f"(tensors{graph} included): run them to the end or call `.close()` on each, or keep "
                f"the values they yield (`.item()`, `.detach()`) instead of the generators")
    if kind == "numpy_views":
        return (f"`{holder}` keeps numpy arrays made with `.numpy()`, which share the tensor's storage and "
                f"keep all of it alive: keep what you need as numbers (`.item()`, `.tolist()`) or a small "
                f"`.copy()` of a slice, and bound it (`collections.deque(maxlen=N)`)")
    if kind == "tensor_attributes":
        return (f"`{holder}` starts a chain of tensors linked through an attribute (`out.prev = last_out`), "
                f"so every step's tensor{graph} stays alive: do not store tensors on tensors; keep the "
                f"last few in a `collections.deque(maxlen=N)` of `.detach()`ed values")
    if kind == "param_groups":
        return (f"`opt.add_param_group` every step keeps each group's tensors (and their optimizer "
                f"state) in `{holder}`: add parameter groups once, before training")
    if kind == "buffer_per_step":
        return ("`register_buffer` under a new name every step keeps every buffer: register it once in "
                "`__init__` and update it in place (`self.buf.copy_(x)`)")
    if kind == "attr_per_step":
        owner = _owner(holder)
        kept = " with its autograd graph" if has_graph else ""
        return (f"`{owner}` gets an attribute under a new name every step (`setattr({owner}, f\"name_{{step}}\", x)`) "
                f"and keeps every one{kept}: keep one attribute overwritten each step "
                f"(`{owner}.last = x.detach()`), or a bounded `collections.deque(maxlen=N)` of `.detach()`ed values")
    if kind == "module_per_step":
        owner = _owner(holder)
        return (f"a submodule is added to `{owner}` under a new name every step (`add_module`, or `setattr` of a "
                f"module), and each keeps its parameters: create it once (in `__init__`, or before the loop) "
                f"and reuse it")
    if kind == "class_attribute":
        return (f"`{holder}` is a class attribute: shared by every instance and never freed; keep it on "
                f"the instance, bound it (`collections.deque(maxlen=N)`), or reset it "
                f"(`{holder}.clear()`) after each step; store `.detach()`ed tensors")
    if kind == "autograd_graph":
        if graph_alive and not graph_freed:
            return (f"`{holder}` keeps every step's graph and activations (never backpropagated): "
                    f"evaluate under `torch.no_grad()`, or accumulate `.item()`/`.detach()` values")
        return (f"`{holder}` keeps every step's autograd graph: accumulate a number "
                f"(`{holder} += loss.item()`) or a detached tensor (`loss.detach()`)")
    if kind == "growing_container":
        if graph_alive and not graph_freed:  # outputs kept with graphs never backpropagated: evaluation
            return (f"`{holder}` stores outputs with their graph and activations (never backpropagated) "
                    f"every step: evaluate under `torch.no_grad()`, or store `x.detach()`/`x.item()`")
        if has_graph:
            return (f"`{holder}` stores tensors with their autograd graph every step: store `x.item()` "
                    f"or `x.detach()` (`.cpu()` for GPU tensors), and bound it")
        return (f"`{holder}` gains tensors every step and is never emptied: bound it "
                f"(`collections.deque(maxlen=N)`, evict old keys) or clear it once used")
    if kind == "module_cache":
        graph = " with their autograd graph" if has_graph else ""
        return (f"`{holder}` caches tensors{graph} on the module every step: keep `.detach()` copies "
                f"in a bounded `collections.deque(maxlen=N)` or clear it after each step")
    if kind == "growing_tensor":
        return (f"`{holder}` is re-grown every step (e.g. `torch.cat`): preallocate it, keep a "
                f"bounded window, or move old parts to CPU")
    if kind == "reference_cycle":
        owner = holder.split(".", 1)[0]
        return (f"`{owner}` objects form reference cycles holding tensors, freed only by the garbage "
                f"collector: break the cycle (`weakref.ref` for the back link, or `del` it when done)")
    return f"`{holder}` keeps growing: release what it holds once it is used"


def _owner(holder: str) -> str:
    """``model.1.__dict__`` -> ``model[1]``: the object whose attribute dict ``holder`` is."""
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", holder.rsplit(".", 1)[0])


def _fix_from_code(kind: str, holder: str, *, graph_alive: bool, has_graph: bool, graph_freed: bool,
                   flags: Collection[str], line: str) -> str:
    """Advice that only what the code does can choose: ``retain_graph`` chains, ``create_graph``
    results, running values rebuilt from each step's loss."""
    if not has_graph or kind in ("hook_per_step", "exception_frames", "suspended_frames", "lru_cache",
                                 "param_groups", "buffer_per_step", "reference_cycle", "attr_per_step",
                                 "module_per_step"):
        return ""
    if "retain_graph" in flags and graph_alive:
        return (f"`{holder}` chains each step's graph onto the last one, and `backward(retain_graph=True)` "
                f"keeps all of it (every backward also runs through every earlier step): cut the chain "
                f"each step (`{holder} = {holder}.detach()`, then `.requires_grad_()` if it is optimised) "
                f"and drop `retain_graph=True`")
    if "create_graph" in flags:
        return (f"`{holder}` keeps results of `torch.autograd.grad(..., create_graph=True)`: each keeps the "
                f"double-backward graph and the activations it saved: store `g.detach()` (or a number, "
                f"`g.norm().item()`), and use `create_graph=True` only for a penalty you backpropagate "
                f"in the same step")
    if kind == "autograd_graph" and "running" in flags and (graph_freed or not graph_alive):
        shown = f" (`{line}`)" if line else ""
        return (f"`{holder}` is a running value rebuilt from itself and each step's loss{shown}, so it "
                f"keeps every step's graph: use values on the right-hand side, the loss's `.item()` "
                f"(or `.detach()`)")
    return ""
