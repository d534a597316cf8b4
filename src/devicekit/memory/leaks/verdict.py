"""From measured series to leaks: the kind of each growing holder and the fix that fits it.

Usage::

    from devicekit.memory.leaks.verdict import kind_of, fix_for

    kind = kind_of(in_module=False, is_tensor=True, nodes_grow=True)   # "autograd_graph"
    fix_for(kind, "total_loss", graph_alive=False, has_graph=True)
"""

from __future__ import annotations

__all__ = ["kind_of", "fix_for"]


def kind_of(*, in_module: bool, is_tensor: bool, nodes_grow: bool) -> str:
    if in_module:
        return "module_cache"
    if is_tensor:
        return "autograd_graph" if nodes_grow else "growing_tensor"
    return "growing_container"


def fix_for(kind: str, holder: str, *, graph_alive: bool, has_graph: bool) -> str:
    """One line of advice for ``holder`` leaking as ``kind``."""
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
