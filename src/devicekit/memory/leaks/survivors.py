"""Survivors: the tensors a step created that are still alive two steps later.

The leak finder starts from the memory, not from a list of names. While it watches, every
object that existed before is frozen (``gc.freeze``, see :mod:`~devicekit.memory.leaks.cycles`),
so ``gc.get_objects()`` lists only objects created since, and after each step's collection only
those still alive: the scan costs what the loop keeps, not the size of the process. Each
tensor's birth step is noted (by weak reference, so a freed tensor whose address is reused is
not mistaken for the old one); a tensor born in step ``s`` and still alive at the end of step
``s + 2`` is a *survivor*: what a leak is made of. A step's temporaries and outputs are gone by
then, and so is what a framework keeps one step longer (the batch a data loader fetched ahead,
the last loss it logs); Adam's state is born once during warm-up.

Usage::

    watch = SurvivorWatch()
    watch.scan(0)                      # baseline (after the gc freeze)
    ...                                # steps 1 and 2
    watch.scan(1); watch.scan(2)
    ...                                # step 3
    for tensor in watch.scan(3):       # born in step 1, still alive now
        print(tensor.shape)
"""

from __future__ import annotations

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
        self._births: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._tensor_types: dict[type, bool] = {}

    def scan(self, step: int) -> list[torch.Tensor]:
        """Note the tensors alive now; return those born in ``step - LAG`` (``step > LAG``)."""
        if self.disabled:
            return []
        young = gc.get_objects()
        if len(young) > MAX_YOUNG:
            self.disabled = (f"survivor tracking off: {len(young):,} objects created while watching "
                             f"(more than {MAX_YOUNG:,}); only named holders were followed")
            self._births.clear()
            return []
        births = self._births
        is_tensor = self._tensor_types
        survivors: list[torch.Tensor] = []
        alive: set[int] = set()
        for obj in young:
            cls = type(obj)
            flag = is_tensor.get(cls)
            if flag is None:
                flag = is_tensor[cls] = issubclass(cls, torch.Tensor)
            if not flag:
                continue
            key = id(obj)
            alive.add(key)
            known = births.get(key)
            if known is None or known[0]() is not obj:
                try:
                    births[key] = (weakref.ref(obj), step)
                except TypeError:  # a tensor subclass without weak references
                    continue
            elif known[1] == step - LAG and step > LAG:
                survivors.append(obj)
        del young
        for key in [k for k in births if k not in alive]:
            del births[key]
        return survivors

    def clear(self) -> None:
        self._births.clear()
