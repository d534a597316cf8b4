"""From measured series to leaks: the kind of each growing holder and the fix that fits it.

``pattern_of`` names the patterns a holder found from the memory reveals by its path: a hook
dict, ``param_groups``, ``_buffers``, an ``lru_cache``, a class attribute, lambdas' default
arguments, exceptions' frames. ``kind_of`` falls back to what the measurement says.

Usage::

    from devicekit.memory.leaks.verdict import kind_of, fix_for, pattern_of

    kind = kind_of(in_module=False, is_tensor=True, nodes_grow=True)   # "autograd_graph"
    fix_for(kind, "total_loss", graph_alive=False, has_graph=True)
    pattern_of("model.1._forward_hooks", via="[3].<closure feats>[0]", origin="local",
               is_lru=False)                                            # "hook_per_step"
"""

from __future__ import annotations

import re

from devicekit.memory.leaks.reach import HOOK_DICTS

__all__ = ["kind_of", "fix_for", "pattern_of", "detail_of", "via_of"]


def via_of(through: int) -> str:
    """A path-like text for measured ``THROUGH`` flags (holders named up front have no path)."""
    return "".join(text for bit, text in ((8, ".__defaults__"), (1, ".<closure>"), (2, ".__traceback__"))
                   if through & bit)


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
    if ".__traceback__" in via:
        return "exception_frames"
    if ".__defaults__" in via or ".__kwdefaults__" in via or ".<closure" in via:
        return "deferred_closure"
    if origin == "class":
        return "class_attribute"
    return None


def detail_of(kind: str, *, via: str, where: str) -> str:
    """The short note printed after the holder: how the pattern holds the memory."""
    if kind == "hook_per_step":
        return f"a hook registered at {where} every step" if where else "a hook registered every step"
    if kind == "lru_cache":
        return "lru_cache"
    if kind == "deferred_closure":
        return "a lambda's default argument" if "__defaults__" in via else "a function's closure variable"
    if kind == "exception_frames":
        return "exceptions keep their traceback frames' locals"
    if kind == "param_groups":
        return "a param group added every step"
    if kind == "buffer_per_step":
        return "a buffer registered every step"
    if kind == "class_attribute":
        return "a class attribute, shared by every instance"
    return ""


def kind_of(*, in_module: bool, is_tensor: bool, nodes_grow: bool) -> str:
    if in_module:
        return "module_cache"
    if is_tensor:
        return "autograd_graph" if nodes_grow else "growing_tensor"
    return "growing_container"


def fix_for(kind: str, holder: str, *, graph_alive: bool, has_graph: bool) -> str:
    """One line of advice for ``holder`` leaking as ``kind``."""
    graph = " and its autograd graph" if has_graph else ""
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
        return (f"`{holder}` keeps exceptions, whose tracebacks keep every frame's locals (tensors "
                f"included): keep `str(e)` or `traceback.format_exc()`, or `e.with_traceback(None)`")
    if kind == "param_groups":
        return (f"`opt.add_param_group` every step keeps each group's tensors (and their optimizer "
                f"state) in `{holder}`: add parameter groups once, before training")
    if kind == "buffer_per_step":
        return ("`register_buffer` under a new name every step keeps every buffer: register it once in "
                "`__init__` and update it in place (`self.buf.copy_(x)`)")
    if kind == "class_attribute":
        return (f"`{holder}` is a class attribute: shared by every instance and never freed; keep it on "
                f"the instance, bound it (`collections.deque(maxlen=N)`), or reset it "
                f"(`{holder}.clear()`) after each step; store `.detach()`ed tensors")
    if kind == "autograd_graph":
        if graph_alive:
            return (f"`{holder}` keeps every step's graph and activations (never backpropagated): "
                    f"evaluate under `torch.no_grad()`, or accumulate `.item()`/`.detach()` values")
        return (f"`{holder}` keeps every step's autograd graph: accumulate a number "
                f"(`{holder} += loss.item()`) or a detached tensor (`loss.detach()`)")
    if kind == "growing_container":
        if graph_alive:  # outputs kept with graphs never backpropagated: an evaluation loop
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
