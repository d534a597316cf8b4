"""Metrics that stay on the device: no host synchronisation until you read them.

The seeds' warning: calling ``loss.item()`` every step makes the host wait for the GPU each
time. ``RunningMean`` and ``MetricLog`` keep their numbers where the values live (sums and a
preallocated history buffer on the GPU) and copy to the host only when read: ``.value``,
``.item()``, ``.compute()`` (a tensor, still on the device), or ``dict(log)``.

Usage::

    import devicekit as dk

    loss_avg = dk.RunningMean()
    log = dk.MetricLog()
    for x, y in loader:
        loss = step(x, y)
        loss_avg.update(loss, n=len(x))      # no sync
        log.append(loss=loss, lr=0.1)        # no sync
    print(loss_avg.value)                    # one sync, here
    history = dict(log)                      # {"loss": [...], "lr": [...]}, one copy per metric
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping

import torch

from devicekit.errors import InvalidValueError

__all__ = ["RunningMean", "MetricLog"]

Number = int | float


def _accumulation_dtype(value: torch.Tensor) -> torch.dtype:
    """float64 (exact enough for long runs); float32 on MPS, which has no float64."""
    if value.is_complex():
        return torch.complex128
    return torch.float32 if value.device.type == "mps" else torch.float64


class RunningMean:
    """A running (weighted) mean of tensors or numbers, kept on the tensors' device.

    ``update(x, n)``: ``x`` is the mean of ``n`` samples (a scalar tensor or a number); a
    tensor with more elements counts each element as one sample. Reading: ``.value`` /
    ``.item()`` (float, one sync), ``.compute()`` (0-d tensor on the device, no sync).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._tensor_sum: torch.Tensor | None = None
        self._number_sum = 0.0
        self._count = 0.0

    @property
    def count(self) -> float:
        """Samples seen (known on the host: reading it never syncs)."""
        return self._count

    def update(self, value: torch.Tensor | Number, n: Number = 1) -> None:
        if isinstance(n, bool) or not isinstance(n, numbers.Real) or n < 0:
            raise InvalidValueError(f"sample count n={n!r} must be a non-negative number")
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if self._tensor_sum is not None and value.device != self._tensor_sum.device:
                raise InvalidValueError(
                    f"value on {value.device} but this RunningMean accumulates on "
                    f"{self._tensor_sum.device}; move it first or use one RunningMean per device"
                )
            if value.numel() != 1:
                n, added = value.numel(), value.sum(dtype=_accumulation_dtype(value))
            else:
                added = value.reshape(()).to(_accumulation_dtype(value)) * n
            if self._tensor_sum is None:
                self._tensor_sum = added.clone()
            else:
                self._tensor_sum.add_(added.to(self._tensor_sum.dtype))
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            self._number_sum += float(value) * n
        else:
            raise InvalidValueError(
                f"RunningMean.update got {type(value).__name__} {value!r}; pass a tensor or a number"
            )
        self._count += n

    def compute(self) -> torch.Tensor:
        """The mean as a 0-d tensor on the accumulation device (no host sync)."""
        if self._count == 0:
            raise InvalidValueError("RunningMean has no values yet; call update() first")
        if self._tensor_sum is None:
            return torch.tensor(self._number_sum / self._count, dtype=torch.float64)
        return (self._tensor_sum + self._number_sum) / self._count

    def item(self) -> float:
        """The mean as a Python float (one host sync)."""
        return float(self.compute().item())

    @property
    def value(self) -> float:
        return self.item()

    def __repr__(self) -> str:
        return f"RunningMean(count={self._count:g})"  # no sync in repr


class _History:
    """A growable 1-D buffer on one device; writing a value is one device-side copy."""

    __slots__ = ("buffer", "size")

    def __init__(self, first: torch.Tensor) -> None:
        self.buffer = torch.empty(64, dtype=first.dtype, device=first.device)
        self.size = 0

    def append(self, value: torch.Tensor | float) -> None:
        if self.size == self.buffer.numel():
            grown = torch.empty(2 * self.size, dtype=self.buffer.dtype, device=self.buffer.device)
            grown[: self.size].copy_(self.buffer)
            self.buffer = grown
        self.buffer[self.size] = value  # a copy kernel (tensor) or a fill (number): no sync
        self.size += 1

    def view(self) -> torch.Tensor:
        return self.buffer[: self.size]


class MetricLog(Mapping[str, list[float]]):
    """Named per-step histories kept on the device; a read-only mapping name -> list of floats.

    ``append(**values)`` records one step (0-d tensors or numbers; no sync). ``compute()``
    returns ``{name: 1-D tensor}`` on the device; ``log[name]``/``dict(log)`` copy to the host
    (one transfer per metric); ``means()`` gives each metric's mean.
    """

    def __init__(self) -> None:
        self._histories: dict[str, _History] = {}

    def reset(self) -> None:
        self._histories.clear()

    def append(self, **values: torch.Tensor | Number) -> None:
        for name, value in values.items():
            history = self._histories.get(name)
            if isinstance(value, torch.Tensor):
                value = value.detach()
                if value.numel() != 1:
                    raise InvalidValueError(
                        f"metric {name!r} has {value.numel()} elements; log one number per step "
                        "(reduce it first, e.g. value.mean())"
                    )
                value = value.reshape(())
                if history is None:
                    history = self._histories[name] = _History(value.to(_accumulation_dtype(value)))
                elif value.device != history.buffer.device:
                    raise InvalidValueError(
                        f"metric {name!r} on {value.device} but its history is on "
                        f"{history.buffer.device}; log each metric from one device"
                    )
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                value = float(value)
                if history is None:
                    history = self._histories[name] = _History(torch.zeros((), dtype=torch.float64))
            else:
                raise InvalidValueError(
                    f"metric {name!r} got {type(value).__name__} {value!r}; pass a tensor or a number"
                )
            history.append(value)

    def compute(self) -> dict[str, torch.Tensor]:
        """``{name: 1-D tensor of every step}`` on the device (no host sync)."""
        return {name: history.view() for name, history in self._histories.items()}

    def means(self) -> dict[str, float]:
        """Each metric's mean over its steps (one sync for all)."""
        if not self._histories:
            return {}
        stacked = [h.view().to(torch.float64).mean() for h in self._histories.values()]
        values = torch.stack([m.cpu() for m in stacked]).tolist()
        return dict(zip(self._histories, values, strict=True))

    def steps(self, name: str) -> int:
        """How many values ``name`` has (known on the host)."""
        history = self._histories.get(name)
        if history is None:
            raise KeyError(name)
        return history.size

    def __getitem__(self, name: str) -> list[float]:
        history = self._histories.get(name)
        if history is None:
            raise KeyError(name)
        return history.view().tolist()

    def __iter__(self) -> Iterator[str]:
        return iter(self._histories)

    def __len__(self) -> int:
        return len(self._histories)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{n}: {h.size} steps" for n, h in self._histories.items())
        return f"MetricLog({sizes})"
