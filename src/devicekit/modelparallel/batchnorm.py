"""BatchNorm for pipelines: running statistics per mini-batch, not per micro-batch.

In a pipeline each BatchNorm sees micro-batches. It normalises each micro-batch with that
micro-batch's statistics (as GPipe does; normalising with the whole batch would need every
micro-batch before the first can go on), but it *accumulates* the statistics of all
micro-batches of a mini-batch and updates ``running_mean``/``running_var`` once, with the
mini-batch's mean and unbiased variance: the running statistics and ``num_batches_tracked``
match one update over all micro-batches' inputs to the layer together (combined exactly, by
Chan's parallel formula). For the first BatchNorm those are the unsplit model's inputs; past
it they come from layers normalised per micro-batch, so they differ from an unsplit run's.
Recomputation under activation checkpointing is not counted twice.

Usage::

    from devicekit.modelparallel.batchnorm import DeferredBatchNorm

    model = DeferredBatchNorm.convert(model)    # BatchNorm{1,2,3}d -> DeferredBatchNorm, same tensors
    for micro in micro_batches:
        outputs.append(model(micro))
    DeferredBatchNorm.commit_all(model)         # one running-stats update for the mini-batch
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from devicekit.modelparallel.recompute import is_recomputing

__all__ = ["DeferredBatchNorm"]


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm that updates its running statistics once per mini-batch (see module doc)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self._count = 0
        self._mean: Tensor | None = None
        self._m2: Tensor | None = None

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _track(self, input: Tensor) -> None:
        dims = [0, *range(2, input.dim())]
        with torch.no_grad():
            x = input.detach().to(self.running_mean.dtype)
            n = input.numel() // input.size(1)
            mean = x.mean(dims)
            m2 = ((x - mean.view(1, -1, *([1] * (input.dim() - 2)))) ** 2).sum(dims)
            if self._mean is None or self._m2 is None:
                self._count, self._mean, self._m2 = n, mean, m2
                return
            total = self._count + n
            delta = mean - self._mean
            self._mean = self._mean + delta * (n / total)
            self._m2 = self._m2 + m2 + delta**2 * (self._count * n / total)
            self._count = total

    def commit(self) -> None:
        """Fold the tracked micro-batches into the running statistics (no-op if none)."""
        if self._mean is None or self._m2 is None:
            return
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            var = self._m2 / max(self._count - 1, 1)
            self.running_mean.mul_(1 - factor).add_(self._mean * factor)
            self.running_var.mul_(1 - factor).add_(var * factor)
        self._count, self._mean, self._m2 = 0, None, None

    def discard(self) -> None:
        """Forget the tracked micro-batches (a failed mini-batch)."""
        self._count, self._mean, self._m2 = 0, None, None

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if not is_recomputing():
            self._track(input)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @classmethod
    def convert(cls, module: nn.Module, _done: dict[int, nn.Module] | None = None) -> nn.Module:
        """Replace every tracking BatchNorm in ``module`` (in place) by one sharing its tensors.

        A BatchNorm object listed twice becomes one DeferredBatchNorm listed twice."""
        done = {} if _done is None else _done
        if id(module) in done:
            return done[id(module)]
        if isinstance(module, _BatchNorm) and not isinstance(module, cls) and module.track_running_stats:
            deferred = cls(module.num_features, module.eps, module.momentum, module.affine)
            if module.affine:
                deferred.weight = module.weight
                deferred.bias = module.bias
            deferred.running_mean = module.running_mean
            deferred.running_var = module.running_var
            deferred.num_batches_tracked = module.num_batches_tracked
            deferred.train(module.training)
            done[id(module)] = deferred
            return deferred
        done[id(module)] = module
        for name, child in list(module._modules.items()):  # every entry, repeats included
            if child is None:
                continue
            new = cls.convert(child, done)
            if new is not child:
                setattr(module, name, new)
        return module

    @classmethod
    def commit_all(cls, module: nn.Module, *, discard: bool = False) -> None:
        """Commit (or with ``discard``, forget) every DeferredBatchNorm inside ``module``."""
        for sub in module.modules():
            if isinstance(sub, cls):
                if discard:
                    sub.discard()
                else:
                    sub.commit()
