"""Copy the next batch to the GPU while the current one computes.

``Prefetcher(loader, device)`` wraps any iterable of batches. On CUDA it issues the copy of
batch ``i+1`` on a side stream before handing out batch ``i``; the compute stream waits for that
copy (``wait_stream``) before it may touch the batch, and every tensor is marked as used by the
compute stream (``record_stream``) so the caching allocator does not hand its memory out while
the compute stream still reads it. The copies overlap compute only from pinned host memory:
give the loader ``pin_memory=True`` (or pass ``pin_memory=True`` here).

On any other device it is a plain loop that moves each batch with ``to_device``.

Usage::

    import devicekit as dk

    loader = DataLoader(dataset, batch_size=256, pin_memory=True, num_workers=4)
    for x, y in dk.Prefetcher(loader, "cuda:0"):
        loss = step(x, y)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Any, Generic, TypeVar

import torch

from devicekit.errors import InvalidValueError
from devicekit.placement.devices import DeviceLike, as_device
from devicekit.placement.transfer import iter_tensors, pin_memory, to_device

__all__ = ["Prefetcher"]

T = TypeVar("T")
_END = object()


class Prefetcher(Generic[T]):
    """Iterate ``iterable`` with each batch already on ``device``; ``len()`` where it has one."""

    def __init__(self, iterable: Iterable[T], device: DeviceLike, *, pin_memory: bool = False) -> None:
        if not isinstance(iterable, Iterable):
            raise InvalidValueError(
                f"Prefetcher needs an iterable of batches (e.g. a DataLoader), got {type(iterable).__name__}"
            )
        self.iterable = iterable
        self.device = as_device(device)
        self.pin_memory = pin_memory
        #: The side stream of the iteration in progress (CUDA only; None before and on CPU).
        self.stream: torch.cuda.Stream | None = None

    def __len__(self) -> int:
        if not isinstance(self.iterable, Sized):
            raise TypeError(f"Prefetcher over {type(self.iterable).__name__}, which has no len()")
        return len(self.iterable)

    def __iter__(self) -> Iterator[T]:
        if self.device.type != "cuda":
            for batch in self.iterable:
                yield to_device(batch, self.device)
            return
        yield from self._cuda_batches()

    def _cuda_batches(self) -> Iterator[T]:
        device = self.device
        side = self.stream = torch.cuda.Stream(device=device)
        source = iter(self.iterable)

        def issue_copy() -> Any:
            try:
                batch = next(source)
            except StopIteration:
                return _END
            if self.pin_memory:
                batch = pin_memory(batch)
            for source_device in {t.device for t in iter_tensors(batch) if t.device.type == "cuda"}:
                # a loader yielding CUDA tensors wrote them on its current stream: the side
                # stream must not read them before that work is done (another GPU's tensors)
                side.wait_stream(torch.cuda.current_stream(source_device))
            with torch.cuda.stream(side):
                return to_device(batch, device)  # async from pinned memory, on the side stream

        upcoming = issue_copy()
        while upcoming is not _END:
            compute = torch.cuda.current_stream(device)
            compute.wait_stream(side)  # the batch is complete before compute reads it
            for tensor in iter_tensors(upcoming):
                if tensor.device.type == "cuda":
                    tensor.record_stream(compute)  # memory stays reserved until compute is done
            ready = upcoming
            upcoming = issue_copy()  # the next copy overlaps the caller's work on `ready`
            yield ready

    def __repr__(self) -> str:
        return f"Prefetcher({type(self.iterable).__name__}, device={self.device})"
