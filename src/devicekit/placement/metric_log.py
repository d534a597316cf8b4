"""Metrics that stay on the device: no host synchronisation until you read them.

The seeds' warning: calling ``loss.item()`` every step makes the host wait for the GPU each
time. ``RunningMean`` and ``MetricLog`` keep their numbers where the values live (a running sum
on the GPU; per-step values stacked on the GPU in chunks) and copy to the host only when read:
``.value``, ``.item()``, ``.compute()`` (a tensor, still on the device), or ``dict(log)``.
Values of CPU tensors are read at once instead: on the CPU the device *is* the host, so
``.item()`` waits for nothing and is the cheapest way to keep them.

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


def _accumulation_dtype(device: torch.device) -> torch.dtype:
    """float64 (exact enough for long runs); float32 on MPS, which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def _check_n(n: object) -> None:
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or n < 0:
        raise InvalidValueError(f"sample count n={n!r} must be a non-negative number")


class RunningMean:
    """A running (weighted) mean of tensors or numbers, kept on the tensors' device.

    ``update(x, n)``: ``x`` is the mean of ``n`` samples (a scalar tensor or a number); a
    tensor with more elements counts each element as one sample. Reading: ``.value`` /
    ``.item()`` (float, one sync), ``.compute()`` (0-d tensor on the device, no sync).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._tensor_sum: torch.Tensor | None = None  # on an accelerator: one add_ per update
        self._host_sum = 0.0  # numbers and CPU tensors
        self._count = 0.0

    @property
    def count(self) -> float:
        """Samples seen (known on the host: reading it never syncs)."""
        return self._count

    def update(self, value: torch.Tensor | Number, n: Number = 1) -> None:
        _check_n(n)
        if isinstance(value, torch.Tensor):
            value = value.detach()
            weight = n
            if value.numel() != 1:  # each element is one sample
                n, weight = value.numel(), 1
                value = value.sum(dtype=_accumulation_dtype(value.device))
            if value.device.type == "cpu":
                self._host_sum += float(value.item()) * weight  # no device queue on a CPU
            else:
                total = self._tensor_sum
                if total is None:
                    total = self._tensor_sum = torch.zeros(
                        (), dtype=_accumulation_dtype(value.device), device=value.device
                    )
                elif value.device != total.device:
                    raise InvalidValueError(
                        f"value on {value.device} but this RunningMean accumulates on "
                        f"{total.device}; move it first or use one RunningMean per device"
                    )
                total.add_(value.reshape(()), alpha=weight)  # one kernel, no sync
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            self._host_sum += float(value) * n
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
            return torch.tensor(self._host_sum / self._count, dtype=torch.float64)
        return (self._tensor_sum + self._host_sum) / self._count

    def item(self) -> float:
        """The mean as a Python float (one host sync)."""
        return float(self.compute().item())

    @property
    def value(self) -> float:
        return self.item()

    def __repr__(self) -> str:
        return f"RunningMean(count={self._count:g})"  # no sync in repr


_CHUNK = 256


class _History:
    """One metric's values in step order: host floats, or 0-d device tensors stacked in chunks.

    On an accelerator an append is a Python list append; every ``_CHUNK`` values become one
    ``torch.stack`` on the device. Nothing is copied to the host until ``view()`` is read.
    """

    __slots__ = ("floats", "chunks", "pending", "device", "dtype", "size")

    def __init__(self) -> None:
        self.floats: list[float] = []
        self.chunks: list[torch.Tensor] = []
        self.pending: list[torch.Tensor] = []
        self.device: torch.device | None = None  # set once device tensors arrive
        self.dtype = torch.float64
        self.size = 0

    def append_number(self, value: float) -> None:
        if self.device is None:
            self.floats.append(value)
        else:  # a fill kernel on the device: no sync
            self.pending.append(torch.full((), value, dtype=self.dtype, device=self.device))
            self._flush_if_full()
        self.size += 1

    def append_tensor(self, value: torch.Tensor, name: str) -> None:
        if self.device is None:
            self.device, self.dtype = value.device, value.dtype
            if self.floats:  # numbers logged before the first device tensor move along
                self.pending = [torch.full((), v, dtype=self.dtype, device=self.device) for v in self.floats]
                self.floats = []
        elif value.device != self.device:
            raise InvalidValueError(
                f"metric {name!r} on {value.device} but its history is on {self.device}; "
                "log each metric from one device"
            )
        if value.dtype != self.dtype:
            value = value.to(self.dtype)
        self.pending.append(value)
        self._flush_if_full()
        self.size += 1

    def _flush_if_full(self) -> None:
        if len(self.pending) >= _CHUNK:
            self.chunks.append(torch.stack(self.pending))
            self.pending = []

    def view(self) -> torch.Tensor:
        """Every value as a 1-D tensor (on the device for device histories)."""
        if self.device is None:
            return torch.tensor(self.floats, dtype=torch.float64)
        if self.pending:
            self.chunks.append(torch.stack(self.pending))
            self.pending = []
        if len(self.chunks) > 1:
            self.chunks = [torch.cat(self.chunks)]
        return self.chunks[0] if self.chunks else torch.empty(0, dtype=self.dtype, device=self.device)

    def values(self) -> list[float]:
        if self.device is None:
            return list(self.floats)
        return self.view().tolist()


class MetricLog(Mapping[str, list[float]]):
    """Named per-step histories kept on the device; a read-only mapping name -> list of floats.

    ``append(**values)`` records one step (0-d tensors or numbers; no sync). ``compute()``
    returns ``{name: 1-D tensor}`` (on the device for device metrics); ``log[name]`` and
    ``dict(log)`` copy to the host (one transfer per metric); ``means()`` gives each mean.
    """

    def __init__(self) -> None:
        self._histories: dict[str, _History] = {}

    def reset(self) -> None:
        self._histories.clear()

    def append(self, **values: torch.Tensor | Number) -> None:
        histories = self._histories
        for name, value in values.items():
            history = histories.get(name)
            if history is None:
                history = histories[name] = _History()
            if type(value) is torch.Tensor and value.is_cpu and history.device is None:
                try:  # fast path: a CPU value is read at once (no device queue to wait for)
                    history.floats.append(value.item())
                except RuntimeError:
                    pass  # not one element: the general path below says so
                else:
                    history.size += 1
                    continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise InvalidValueError(
                        f"metric {name!r} has {value.numel()} elements; log one number per step "
                        "(reduce it first, e.g. value.mean())"
                    )
                if value.device.type == "cpu":
                    history.append_number(float(value.item()))  # no device queue on a CPU
                else:
                    history.append_tensor(value.detach().reshape(()), name)
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                history.append_number(float(value))
            else:
                if not history.size:
                    del self._histories[name]
                raise InvalidValueError(
                    f"metric {name!r} got {type(value).__name__} {value!r}; pass a tensor or a number"
                )

    def compute(self) -> dict[str, torch.Tensor]:
        """``{name: 1-D tensor of every step}``, on the device for device metrics (no sync)."""
        return {name: history.view() for name, history in self._histories.items()}

    def means(self) -> dict[str, float]:
        """Each metric's mean over its steps (one transfer per device metric)."""
        return {
            name: float(history.view().to(torch.float64).mean().item()) if history.size else float("nan")
            for name, history in self._histories.items()
        }

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
        return history.values()

    def __iter__(self) -> Iterator[str]:
        return iter(self._histories)

    def __len__(self) -> int:
        return len(self._histories)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{n}: {h.size} steps" for n, h in self._histories.items())
        return f"MetricLog({sizes})"
