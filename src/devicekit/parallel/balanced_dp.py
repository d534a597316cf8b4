"""DataParallel without the device-0 hotspot: each replica computes its own loss.

``nn.DataParallel`` gathers every replica's *outputs* onto device 0 and computes the loss
there, so device 0 holds all the logits and all the loss activations: it runs out of memory
first and sets the pace (the seeds: "compute the loss during the forward pass ... a parallel
loss function layer"). ``BalancedDataParallel`` replicates the model **together with the loss
function**, so each GPU computes the loss on its own chunk and only one scalar per GPU is
gathered. The result is the batch-size-weighted mean of the chunk losses (their sum for a
``reduction='sum'`` loss), which equals the single-device loss, and its gradients match.

Usage::

    import devicekit as dk

    model = dk.BalancedDataParallel(net, torch.nn.CrossEntropyLoss())   # every visible GPU
    for x, y in loader:
        loss = model(x, y)           # a scalar on output_device (default: the first GPU)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    loss, outputs = model(x, y, return_outputs=True)   # outputs stay on their own GPUs

On GPUs of different speed pass ``weights="auto"`` (the capability score: the cached
``devicekit bench`` figures, else datasheet peaks) or ``weights=[3, 2, 1]``: each GPU gets a
share of the batch in proportion, so the fast one does not wait for the slow one, and the loss
(hence the gradients) still equals the single-device step::

    model = dk.BalancedDataParallel(net, nn.CrossEntropyLoss(), weights="auto")

Honest advice: DistributedDataParallel (:func:`devicekit.ddp` with ``devicekit run --gpus N``)
is faster and is what PyTorch recommends; this class is for quick single-process experiments.
With one GPU the model and loss simply run there; with no GPU (``device_ids`` empty, the
default on a CPU machine) it is a plain ``loss_fn(model(inputs), targets)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import gather, parallel_apply, replicate
from torch.nn.parallel.scatter_gather import scatter_kwargs

from devicekit.errors import InvalidDeviceError, InvalidValueError
from devicekit.parallel.weighted_split import chunk, resolve_weights, split_sizes

__all__ = ["BalancedDataParallel", "combine_losses", "weighted_mean"]


class _ModelWithLoss(nn.Module):
    """model + loss in one module, so ``replicate`` copies both onto every device."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], dim: int) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn  # an nn.Module loss is registered (and replicated) as a child
        self.dim = dim

    def forward(self, inputs: Any, targets: Any, **kwargs: Any) -> tuple[torch.Tensor, int, Any]:
        outputs = self.model(inputs, **kwargs)
        loss = self.loss_fn(outputs, targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InvalidValueError(
                f"loss_fn must return a scalar tensor, got "
                f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}; "
                f"use reduction='mean' or 'sum'")
        return loss.reshape(()), _batch_size(targets, self.dim), outputs


def _batch_size(obj: Any, dim: int) -> int:
    """Size along ``dim`` of the first tensor found in ``obj`` (tensors, lists, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        return int(obj.shape[dim]) if obj.dim() > 0 else 1
    if isinstance(obj, (list, tuple)):
        for item in obj:
            size = _batch_size(item, dim)
            if size:
                return size
    if isinstance(obj, dict):
        for item in obj.values():
            size = _batch_size(item, dim)
            if size:
                return size
    return 0


def weighted_mean(losses: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
    """``sum(loss_i * n_i) / sum(n_i)`` on the first loss's device: the full-batch mean loss
    from per-chunk mean losses, also when the chunks have different sizes."""
    if len(losses) != len(sizes) or not losses:
        raise InvalidValueError(f"need one size per loss, got {len(losses)} losses, {len(sizes)} sizes")
    total = sum(sizes)
    if total <= 0:
        return torch.stack([loss.reshape(()) for loss in losses]).mean()
    weights = torch.tensor([s / total for s in sizes], dtype=losses[0].dtype,
                           device=losses[0].device)
    return (torch.stack([loss.reshape(()) for loss in losses]) * weights).sum()


def combine_losses(losses: Sequence[torch.Tensor], sizes: Sequence[int],
                   reduction: str) -> torch.Tensor:
    """The single-device loss from per-chunk losses: their sum for ``"sum"``, otherwise
    :func:`weighted_mean`."""
    if reduction == "sum":
        return torch.stack([loss.reshape(()) for loss in losses]).sum()
    return weighted_mean(losses, sizes)


def _device_index(device: Any) -> int:
    """A CUDA device index from an int, 'cuda:1' or torch.device; a one-line error otherwise."""
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidDeviceError(f"unknown device {device!r}; use a GPU index or 'cuda:N'") from None
    if dev.type != "cuda":
        raise InvalidDeviceError(
            f"BalancedDataParallel splits over CUDA devices, got {device!r}; pass device_ids=None "
            f"on a machine without GPUs for a plain call")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:  # "pick an index below 0" helps nobody: say why there is none
        from devicekit.placement.devices import no_cuda_reason

        raise InvalidDeviceError(
            f"device {device!r}: this process sees no CUDA device ({no_cuda_reason()}); pass"
            " device_ids=None to run the module as is")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if not 0 <= index < count:
        raise InvalidDeviceError(
            f"device {device!r} does not exist: {count} CUDA device(s) visible; pick an index "
            f"below {count}")
    return index


class BalancedDataParallel(nn.Module):
    """DataParallel that computes the loss inside each replica; ``forward(inputs, targets)``
    returns the reduced loss.

    ``device_ids`` defaults to every visible GPU (none on a CPU machine: plain call);
    ``output_device`` (where the loss lands) defaults to ``device_ids[0]``; ``dim`` is the
    batch dimension along which ``inputs`` and ``targets`` are split. The model is moved to
    ``device_ids[0]`` here, as DataParallel requires. Keyword arguments of ``forward`` other
    than ``return_outputs`` are scattered and passed to the model.

    ``reduction`` says how the per-GPU losses combine so that the result equals the
    single-device loss: ``"mean"``, the batch-size-weighted mean (for losses that average over
    the batch, no class weights); ``"sum"``, their sum (for ``reduction='sum'`` losses);
    ``"auto"`` (default) reads ``loss_fn.reduction`` (torch's loss modules have it) and
    otherwise assumes ``"mean"``.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
                 device_ids: Sequence[int | str | torch.device] | None = None,
                 output_device: int | str | torch.device | None = None, dim: int = 0,
                 reduction: str = "auto", weights: Sequence[float] | str | None = None) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise InvalidValueError(
                f"BalancedDataParallel needs an nn.Module model, got {type(model).__name__}")
        if not callable(loss_fn):
            raise InvalidValueError(f"loss_fn={loss_fn!r} is not callable; pass e.g. nn.CrossEntropyLoss()")
        if reduction not in ("auto", "mean", "sum"):
            raise InvalidValueError(f"reduction={reduction!r} must be 'auto', 'mean' or 'sum'")
        if reduction == "auto":
            reduction = "sum" if getattr(loss_fn, "reduction", None) == "sum" else "mean"
        self.reduction = reduction
        if device_ids is None:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            self.device_ids: list[int] = list(range(count))
        else:
            self.device_ids = [_device_index(d) for d in device_ids]
        if len(set(self.device_ids)) != len(self.device_ids):
            raise InvalidValueError(f"device_ids={list(device_ids or [])!r} repeats a device")
        self.dim = dim
        #: each device's share of a batch (None: equal shares, as DataParallel)
        self.weights = resolve_weights(weights, self.device_ids) if self.device_ids else None
        self.module = model  # state_dict keys read "module.<name>", as with DataParallel
        self.loss_fn = loss_fn
        # The replicated unit shares model and loss with self but is not registered as a child,
        # so parameters and state_dict entries are not listed twice.
        object.__setattr__(self, "_wrapped", _ModelWithLoss(model, loss_fn, dim))
        if self.device_ids:
            self.output_device = (self.device_ids[0] if output_device is None
                                  else _device_index(output_device))
            self._wrapped.to(torch.device("cuda", self.device_ids[0]))
        else:
            if output_device is not None:
                raise InvalidValueError(
                    f"output_device={output_device!r} given but no CUDA device is used; drop it")
            self.output_device = None

    def forward(self, inputs: Any, targets: Any, *, return_outputs: bool = False,
                **kwargs: Any) -> Any:
        """The loss of ``model(inputs, **kwargs)`` against ``targets``; with
        ``return_outputs=True`` a pair ``(loss, outputs)`` where ``outputs`` is the list of each
        device's outputs, left on that device (a single-element list without GPUs)."""
        if not self.device_ids:
            loss, _, outputs = self._wrapped(inputs, targets, **kwargs)
            return (loss, [outputs]) if return_outputs else loss
        if self.weights is not None:
            scattered, scattered_kwargs, used = self._weighted_scatter(inputs, targets, kwargs)
        else:
            scattered, scattered_kwargs = scatter_kwargs((inputs, targets), kwargs,
                                                         self.device_ids, dim=self.dim)
            used = self.device_ids[: len(scattered)]
        if not scattered:
            raise InvalidValueError("BalancedDataParallel got an empty batch; pass inputs and targets")
        if len(used) == 1:
            results = [self._wrapped(*scattered[0], **scattered_kwargs[0])]
        else:
            replicas = replicate(self._wrapped, used, not torch.is_grad_enabled())
            results = parallel_apply(replicas, scattered, scattered_kwargs, used)
        losses = [loss.reshape(1) for loss, _, _ in results]
        sizes = [size for _, size, _ in results]
        # Gather keeps autograd: backward sends each scalar's gradient to its own device.
        gathered = gather(losses, self.output_device, dim=0)
        loss = combine_losses(list(gathered.unbind(0)), sizes, self.reduction)
        if return_outputs:
            return loss, [outputs for _, _, outputs in results]
        return loss

    def _weighted_scatter(self, inputs: Any, targets: Any, kwargs: dict[str, Any]
                          ) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]], list[int]]:
        """Cut the batch by :attr:`weights` and send each piece to its device (autograd kept)."""
        from devicekit.placement.transfer import to_device

        total = _batch_size(inputs, self.dim)
        if total == 0:
            return [], [], []
        sizes = split_sizes(total, self.weights or [])
        keep = [i for i, size in enumerate(sizes) if size > 0]
        sizes = [sizes[i] for i in keep]
        pieces = chunk((inputs, targets, kwargs), sizes, self.dim)
        devices = [torch.device("cuda", self.device_ids[i]) for i in keep]
        moved = [to_device(p, d) for p, d in zip(pieces, devices, strict=True)]
        return ([(p[0], p[1]) for p in moved], [p[2] for p in moved],
                [self.device_ids[i] for i in keep])

    def extra_repr(self) -> str:
        return (f"device_ids={self.device_ids}, output_device={self.output_device}, dim={self.dim}, "
                f"reduction={self.reduction!r}, weights={self.weights}")
