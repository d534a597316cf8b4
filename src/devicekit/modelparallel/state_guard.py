"""Run a model for planning and put it back as it was; say which buffers its forward wrote.

Building a split or a pipeline runs the model on the sample (profiling, the per-sample check).
That must leave the model as it was: a forward that counts steps (``self.steps.add_(1)``), keeps a
running sum, or assigns a new tensor to a buffer (``self.ema = 0.9 * self.ema + ...``) would
otherwise be changed by building. :class:`StateGuard` notes every buffer of the modules it guards
(the tensor object, its version counter and a copy of its values) and, on exit, puts back the
object and the values of each buffer that was replaced or written in place, and the random
number generators' states. :attr:`StateGuard.written` names those buffers (qualified names,
BatchNorm running statistics listed apart in :attr:`StateGuard.batch_norm_written`).

Usage::

    from devicekit.modelparallel.state_guard import StateGuard

    with StateGuard(model) as guard:
        model(sample)
    guard.written            # ['counter.steps']: written by forward, now as it was before
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from devicekit.errors import SplitError

__all__ = ["StateGuard", "refuse_written_buffers"]


def refuse_written_buffers(name: str, chunks: int, written: Iterable[str]) -> None:
    """A buffer the forward writes (a step counter) would be written once per micro-batch: refused."""
    first = next(iter(written), None)
    if first is not None and chunks > 1:
        raise SplitError(
            f"cannot pipeline {name} with chunks={chunks}: buffer {first!r} is written in its forward, so "
            f"run per micro-batch it would be updated {chunks} times per batch where the unsplit model updates "
            "it once; use chunks=1 or dk.split(model, devices) (BatchNorm running statistics are handled)")


class StateGuard:
    """A context manager that restores the buffers of ``modules`` and the RNG states on exit."""

    def __init__(self, modules: nn.Module | Iterable[nn.Module], *, prefix: str = "") -> None:
        roots = [modules] if isinstance(modules, nn.Module) else list(modules)
        self._entries: list[tuple[str, nn.Module, str, torch.Tensor, int, torch.Tensor | None]] = []
        seen: set[int] = set()
        for root in roots:
            for name, module in root.named_modules(remove_duplicate=False):
                if id(module) in seen:
                    continue
                seen.add(id(module))
                for key, buf in module._buffers.items():
                    if buf is None:
                        continue
                    full = f"{prefix}{name}.{key}" if name else f"{prefix}{key}"
                    copy = None if buf.device.type == "meta" else buf.detach().clone()
                    self._entries.append((full, module, key, buf, buf._version, copy))
        self._devices = sorted({b.device.index or 0 for *_, b, _v, _c in self._entries if b.is_cuda})
        self._rng = torch.random.fork_rng(devices=self._devices)
        self.written: list[str] = []
        self.batch_norm_written: list[str] = []

    def __enter__(self) -> StateGuard:
        self._rng.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            for full, module, key, buf, version, copy in self._entries:
                current = module._buffers.get(key)
                if current is buf and buf._version == version and (copy is None or _same(buf, copy)):
                    continue  # (a kernel such as batch_norm's may write without a new version)
                (self.batch_norm_written if isinstance(module, _BatchNorm) else self.written).append(full)
                module._buffers[key] = buf
                if copy is not None:
                    with torch.no_grad():
                        buf.copy_(copy)
        finally:
            self._rng.__exit__(kind, exc, tb)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                                             and torch.equal(a.nan_to_num(), b.nan_to_num())))
