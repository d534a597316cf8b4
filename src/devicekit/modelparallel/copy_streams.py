"""Move pipeline activations between devices on side CUDA streams, off the compute streams.

A stage's output is produced on its device's current (compute) stream. The producer records a
CUDA event there (:func:`mark`); the next stage copies the activation on a side *copy stream*
per device that first waits for that event, then its own compute stream waits for the copy
(:meth:`CopyStreams.receive`). Tensors used on a stream other than the one they were allocated
on are ``record_stream``-ed, so the caching allocator does not hand their memory out while a
copy or a computation still reads it. The copies are ordinary ``Tensor.to`` calls, so autograd
tracks them (backward runs on the same streams, with torch's own stream synchronisation).
On CPU, or with no CUDA tensor involved, everything reduces to :func:`~devicekit.modelparallel.microbatch.move`.

Usage::

    from devicekit.modelparallel.copy_streams import CopyStreams, mark

    marks = mark(y)                              # in the producer's thread, after computing y
    streams = CopyStreams()                      # one per receiving stage
    x = streams.receive(y, torch.device("cuda:1"), marks)   # in the consumer's thread
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import torch

from devicekit.modelparallel.microbatch import move

__all__ = ["CopyStreams", "Marks", "mark", "tensors_in"]

#: (device, event recorded on that device's current stream) for each CUDA device a value lives on
Marks = tuple[tuple[torch.device, Any], ...]


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj`` (nested tuple/list/dict)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)


def mark(value: Any) -> Marks:
    """An event on the current stream of every CUDA device ``value``'s tensors live on (none on CPU)."""
    devices = {t.device for t in tensors_in(value) if t.is_cuda}
    marks = []
    for device in sorted(devices, key=str):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        marks.append((device, event))
    return tuple(marks)


class CopyStreams:
    """One receiving stage's copy streams, one per CUDA device, created on first use."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        found = self._streams.get(device)
        if found is None:
            found = self._streams[device] = torch.cuda.Stream(device)
        return found

    @property
    def streams(self) -> dict[torch.device, torch.cuda.Stream]:
        return dict(self._streams)

    def receive(self, value: Any, device: torch.device, marks: Marks) -> Any:
        """``value`` on ``device``, ready to use on ``device``'s current stream."""
        if not marks and device.type != "cuda":
            return move(value, device)  # CPU to CPU: nothing to order
        sources = [t for t in tensors_in(value) if t.device != device]
        if not sources:  # same device: only order the consumer's stream after the producer's
            if marks:
                compute = torch.cuda.current_stream(device)
                for where, event in marks:
                    if where == device:
                        compute.wait_event(event)
                for t in tensors_in(value):  # the producer's stream may differ (a caller's stream)
                    t.record_stream(compute)
            return value
        involved = {t.device for t in sources if t.is_cuda}
        if device.type == "cuda":
            involved.add(device)
        with ExitStack() as stack:
            for where in sorted(involved, key=str):
                copy_stream = self.stream(where)
                for marked, event in marks:  # the copy starts once the producer has written
                    if marked == where:
                        copy_stream.wait_event(event)
                stack.enter_context(torch.cuda.stream(copy_stream))
            out = move(value, device)
            for t in sources:
                if t.is_cuda:  # read by the copy stream, allocated on the producer's stream
                    t.record_stream(self.stream(t.device))
        if device.type == "cuda":
            compute = torch.cuda.current_stream(device)
            compute.wait_stream(self.stream(device))
            for t in tensors_in(out):
                if t.is_cuda and t.device == device:
                    t.record_stream(compute)  # allocated on the copy stream, used on compute
        return out
