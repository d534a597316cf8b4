"""Reference cycles that hold tensors: memory only ``gc.collect()`` gives back.

While watching, automatic collection is off and every object that existed before is frozen
(``gc.freeze``), so each step's collection looks only at objects made since; it runs with
``DEBUG_SAVEALL`` to see the unreachable objects, notes the tensors among them and the object
attribute that held them (``Node.payload``), then really frees them with a second collection.
The holder's class is returned so the line tracer can spot where the next one is created.
Everything is restored on :meth:`CycleWatch.stop`.

Usage::

    watch = CycleWatch(lines=True)
    watch.start()
    ...                     # a step
    found = watch.sample()  # CycleSample(bytes=4096, holder="Node.payload", holder_type=Node)
    watch.stop()
"""

from __future__ import annotations

import gc
from collections import Counter
from typing import Any, NamedTuple

import torch

from devicekit.memory.tensors import total_bytes

__all__ = ["CycleSample", "CycleWatch"]


class CycleSample(NamedTuple):
    bytes: int
    holder: str | None
    holder_type: type | None


class CycleWatch:
    """See the module docstring."""

    def __init__(self) -> None:
        self.active = False
        self._was_enabled = True
        self._froze = False

    def start(self) -> None:
        if self.active:
            return
        self._was_enabled = gc.isenabled()
        gc.disable()  # no full collection here: pre-existing garbage is frozen, left as it was
        self._froze = gc.get_freeze_count() == 0  # never undo a freeze the program made itself
        if self._froze:
            gc.freeze()
        self.active = True

    def stop(self) -> None:
        if not self.active:
            return
        if self._froze:
            gc.unfreeze()  # back into the oldest generation: collected as it would have been
        if self._was_enabled:
            gc.enable()
        self.active = False

    def sample(self) -> CycleSample:
        """Collect now; return the bytes of tensors found in cyclic garbage and who held them."""
        debug = gc.get_debug()
        start = len(gc.garbage)
        gc.set_debug(debug | gc.DEBUG_SAVEALL)
        try:
            gc.collect()
        finally:
            gc.set_debug(debug)
        garbage = gc.garbage[start:]
        del gc.garbage[start:]
        if not garbage:
            return CycleSample(0, None, None)
        tensors = [o for o in garbage if issubclass(type(o), torch.Tensor)]
        result = CycleSample(0, None, None)
        if tensors:
            result = self._describe(garbage, tensors)
        del garbage, tensors
        gc.collect()  # free them for real: they were only kept to be looked at
        return result

    def _describe(self, garbage: list[Any], tensors: list[torch.Tensor]) -> CycleSample:
        tensor_ids = {id(t) for t in tensors}
        names: Counter[str] = Counter()
        types: dict[str, type] = {}
        for obj in garbage:
            attrs = getattr(obj, "__dict__", None)
            if not isinstance(attrs, dict) or issubclass(type(obj), torch.Tensor):
                continue
            for key, value in attrs.items():
                if id(value) in tensor_ids:
                    name = f"{type(obj).__name__}.{key}"
                    names[name] += 1
                    types[name] = type(obj)
        if names:
            holder = names.most_common(1)[0][0]
            return CycleSample(total_bytes(tensors), holder, types[holder])
        return CycleSample(total_bytes(tensors), f"cycle of {type(garbage[0]).__name__} objects", None)
