"""Survivors: the tensors a step created that are still alive two steps later.

The leak finder starts from the memory, not from a list of names. While it watches, every
object that existed before is frozen (``gc.freeze``, see :mod:`~devicekit.memory.leaks.cycles`)
and automatic collection is paused, so the youngest generations hold only what was made since
the last step's collection: :meth:`SurvivorWatch.note` looks at those alone (before the step's
collection moves the survivors into the oldest generation), and notes each tensor's birth step
by weak reference (a freed tensor whose address is reused is not mistaken for the old one). A
note costs what one step made, not what the loop has kept so far (a leak makes that grow); when
something else ran a collection in between, it looks at every object made while watching. A
tensor born in step ``s`` and still alive at the end of step ``s + 2`` is a *survivor*: what a
leak is made of. A step's temporaries and outputs are gone by then, and so is what a framework
keeps one step longer (the batch a data loader fetched ahead, the last loss it logs); Adam's
state is born once during warm-up.

Usage::

    watch = SurvivorWatch()
    watch.note(0); watch.scan(0)       # baseline (after the gc freeze)
    ...                                # steps 1 and 2, each: note, gc.collect(), scan
    ...                                # step 3
    watch.note(3)
    gc.collect()
    for tensor in watch.scan(3):       # born in step 1, still alive now
        print(tensor.shape)
"""

from __future__ import annotations

import functools
import gc
import weakref
from typing import Any

import torch

__all__ = ["SurvivorWatch", "signature"]

#: steps a tensor must outlive its own to be a survivor
LAG = 2
#: above this many young objects a scan would cost more than a step: survivors are not followed
MAX_YOUNG = 200_000


def signature(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What tensors made by the same line share: dtype, shape, device, autograd state."""
    grad_fn = tensor.grad_fn
    return (tensor.dtype, tuple(tensor.shape), str(tensor.device), tensor.requires_grad,
            type(grad_fn).__name__ if grad_fn is not None else None)


class SurvivorWatch:
    """See the module docstring."""

    def __init__(self) -> None:
        self.disabled: str | None = None
        self._born: dict[int, list[weakref.ref[torch.Tensor]]] = {}  # step -> the tensors born then
        self._known: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> weak reference, while alive
        self._tensor_types: dict[type, bool] = {}
        self._collections: int | None = None  # collections of the older generations, after the last scan

    def note(self, step: int) -> None:
        """Note the tensors made since the last scan (call it before the step's garbage
        collection: afterwards everything is in the oldest generation)."""
        if self.disabled:
            return
        if self._collections is None or self._collections != _older_collections():
            young = gc.get_objects()  # someone else collected: what is new may be anywhere
        else:
            young = gc.get_objects(generation=0) + gc.get_objects(generation=1)
        if len(young) > MAX_YOUNG:
            self.disabled = (f"survivor tracking off: {len(young):,} objects created while watching "
                             f"(more than {MAX_YOUNG:,}); only named holders were followed")
            self.clear()
            return
        known = self._known
        is_tensor = self._tensor_types
        born = self._born.setdefault(step, [])
        for obj in young:
            cls = type(obj)
            flag = is_tensor.get(cls)
            if flag is None:
                flag = is_tensor[cls] = issubclass(cls, torch.Tensor)
            if not flag:
                continue
            key = id(obj)
            ref = known.get(key)
            if ref is not None and ref() is obj:
                continue
            try:
                ref = weakref.ref(obj, functools.partial(_forget, known, key))
            except TypeError:  # a tensor subclass without weak references
                continue
            known[key] = ref
            born.append(ref)
        del young

    def scan(self, step: int) -> list[torch.Tensor]:
        """The tensors born in ``step - LAG`` (``step > LAG``) still alive now, after the step's
        garbage collection; what :meth:`note` saw since is born in ``step``."""
        if self.disabled:
            return []
        if step not in self._born:  # not noted before the collection (no cycle check): note now
            self._collections = None
            self.note(step)
        self._collections = _older_collections()
        refs = self._born.pop(step - LAG, []) if step >= LAG else []
        return [tensor for ref in refs if (tensor := ref()) is not None] if step > LAG else []

    def clear(self) -> None:
        self._born.clear()
        self._known.clear()
        self._collections = None


def _older_collections() -> int:
    """Collections of generations 1 and 2 so far (the detector's own included)."""
    stats = gc.get_stats()
    return int(stats[1]["collections"]) + int(stats[2]["collections"])


def _forget(known: dict[int, weakref.ref[Any]], key: int, ref: weakref.ref[Any]) -> None:
    if known.get(key) is ref:
        del known[key]
