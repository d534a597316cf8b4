"""devicekit in a Lightning Trainer: memory per step, leak checks, OOM bundles, batch size.

Works with ``lightning`` (``lightning.pytorch``) or, where that is what is installed, the older
``pytorch_lightning`` package; ``pip install 'devicekit[lightning]'``. Importing this module
imports no other framework.

Usage::

    import lightning as L
    from devicekit.integrations.lightning import DeviceKitCallback

    trainer = L.Trainer(max_epochs=3, callbacks=[DeviceKitCallback(leak_check_steps=6, oom_dir="oom")])
    trainer.fit(module)          # a leak: a dk.LeakWarning naming self.<attribute>, its line, the fix

Memory figures (``devicekit/rss_mib`` on CPU; ``devicekit/allocated_mib``, ``reserved_mib``,
``peak_allocated_mib`` on CUDA) go through ``LightningModule.log_dict`` from rank 0 at the
Trainer's ``log_every_n_steps``. Leak checks run on rank 0 only; nothing synchronises ranks.
On an out-of-memory error each rank writes its bundle to ``oom_dir/rank<R>/`` and Lightning
re-raises the error. ``find_batch_size(module)`` is devicekit's exact finder; with
``batch_size_search={...}`` it runs when fitting starts (every DDP rank agrees on the answer).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from devicekit.errors import InvalidValueError, MissingDependencyError
from devicekit.integrations.monitor import TrainingMonitor

try:
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # the older package name
    try:
        from pytorch_lightning import Callback, LightningModule, Trainer  # type: ignore[no-redef]
    except ImportError:
        raise MissingDependencyError(
            "devicekit.integrations.lightning needs Lightning, which is not installed; "
            "pip install 'devicekit[lightning]'"
        ) from None

__all__ = ["DeviceKitCallback"]

_SEARCH_KEYS = {"start", "minimum", "maximum", "multiple_of", "attr"}


class DeviceKitCallback(Callback):
    """A Lightning callback; options as :class:`devicekit.integrations.monitor.TrainingMonitor`.

    ``log_every``: log memory every N steps (default: the Trainer's ``log_every_n_steps``).
    ``batch_size_search``: a dict of :meth:`find_batch_size` options (or True for the defaults)
    to search the batch size when fitting starts.
    """

    def __init__(self, *, log_every: int | None = None, leak_check_steps: int | None = 6,
                 leak_check_every: int | None = None, oom_dir: str | Path | None = "devicekit-oom",
                 oom_snapshot: bool = True, batch_size_search: Mapping[str, Any] | bool | None = None,
                 prefix: str = "devicekit/") -> None:
        self.monitor = TrainingMonitor(log_every=log_every, leak_check_steps=leak_check_steps,
                                       leak_check_every=leak_check_every, oom_dir=oom_dir,
                                       oom_snapshot=oom_snapshot, prefix=prefix)
        if batch_size_search is True:
            batch_size_search = {}
        if batch_size_search not in (None, False):
            if not isinstance(batch_size_search, Mapping) or set(batch_size_search) - _SEARCH_KEYS:
                raise InvalidValueError(
                    f"batch_size_search={batch_size_search!r} must be True or a dict with keys from "
                    f"{sorted(_SEARCH_KEYS)}"
                )
        self.batch_size_search = dict(batch_size_search) if batch_size_search else None
        self.batch_size: int | None = None
        self._interval = 1
        self._steps = 0

    @property
    def leak_reports(self) -> list:
        """Every finished leak check (a ``LeakReport`` each), clean ones included."""
        return self.monitor.leak_reports

    @property
    def bundles(self) -> list[Path]:
        """Folders of the OOM bundles this rank wrote."""
        return self.monitor.bundles

    # -- Lightning hooks ---------------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.batch_size_search is not None:
            self.find_batch_size(pl_module, **self.batch_size_search)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._interval = self.monitor.log_every or max(int(trainer.log_every_n_steps), 1)
        self._steps = 0
        self.monitor.begin(rank=int(trainer.global_rank), device=pl_module.device)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._steps += 1
        # Lightning writes step metrics when (batches stepped + 1) % log_every_n_steps == 0;
        # its counter is incremented after this hook, so it still reads the step's own number - 1
        stepped = _batches_stepped(trainer, self._steps - 1)
        log = (stepped + 1) % self._interval == 0
        figures = self.monitor.after_step(self._steps, {"self": pl_module}, log=log)
        if figures and trainer.global_rank == 0 and trainer.loggers:
            pl_module.log_dict(figures, on_step=True, on_epoch=False, prog_bar=False, logger=True,
                               rank_zero_only=True)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.monitor.on_error(exception)  # Lightning re-raises it after the callbacks

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.monitor.end()

    # -- batch size ----------------------------------------------------------------------------
    def find_batch_size(self, module: LightningModule, *, start: int = 2, minimum: int = 1,
                        maximum: int | None = None, multiple_of: int = 1, attr: str = "batch_size") -> int:
        """The largest batch size whose training step (forward and backward) fits; sets it.

        Each trial sets ``module.<attr>`` (or ``module.hparams.<attr>``), takes one batch from
        ``module.train_dataloader()`` and runs ``training_step`` and backward on it. The answer
        is exact (doubling, then bisection), the same on every DDP rank, and left in ``attr``.
        Optimizer state (Adam's two copies of the weights) is not part of a trial: leave room.
        """
        import devicekit as dk

        holder = _batch_size_holder(module, attr)
        original_log, original_log_dict = module.__dict__.get("log"), module.__dict__.get("log_dict")
        module.log = module.log_dict = _ignore  # type: ignore[method-assign]  # no trainer context here
        was_training = module.training
        module.train()

        def trial(n: int) -> None:
            _set(holder, attr, n)
            batch = next(iter(module.train_dataloader()))
            batch = dk.to_device(batch, module.device)
            out = module.training_step(batch, 0)
            loss = out["loss"] if isinstance(out, Mapping) else out
            if not isinstance(loss, torch.Tensor):
                raise InvalidValueError(
                    f"training_step returned {type(out).__name__}; the batch-size search needs the loss tensor"
                )
            loss.backward()
            module.zero_grad(set_to_none=True)

        try:
            found = dk.find_batch_size(trial, start=start, minimum=minimum, maximum=maximum,
                                       multiple_of=multiple_of)
        finally:
            for name, value in (("log", original_log), ("log_dict", original_log_dict)):
                if value is None:
                    module.__dict__.pop(name, None)
                else:
                    setattr(module, name, value)
            module.train(was_training)
        _set(holder, attr, int(found))
        self.batch_size = int(found)
        return self.batch_size


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def _batches_stepped(trainer: Trainer, default: int) -> int:
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    value = getattr(loop, "_batches_that_stepped", None)
    return int(value) if isinstance(value, int) else default


def _batch_size_holder(module: LightningModule, attr: str) -> Any:
    if not isinstance(attr, str) or not attr.isidentifier():
        raise InvalidValueError(f"attr={attr!r} must be the name of the batch-size attribute, e.g. 'batch_size'")
    if hasattr(module, attr):
        return module
    hparams = getattr(module, "hparams", None)
    if hparams is not None and attr in hparams:
        return hparams
    raise InvalidValueError(
        f"{type(module).__name__} has no attribute {attr!r} (nor hparams.{attr}); its train_dataloader() "
        f"must read the batch size from it"
    )


def _set(holder: Any, attr: str, value: int) -> None:
    if isinstance(holder, Mapping):
        holder[attr] = value  # type: ignore[index]
    else:
        setattr(holder, attr, value)
