"""devicekit in a Hugging Face Trainer: memory per step, leak checks, OOM bundles, batch size.

``pip install 'devicekit[transformers]'``. Importing this module imports no other framework.

Usage::

    from transformers import Trainer
    from devicekit.integrations.transformers import DeviceKitCallback

    trainer = Trainer(model, args, train_dataset=data, callbacks=[DeviceKitCallback(oom_dir="oom")])
    trainer.train()              # a leak: a dk.LeakWarning naming self.<attribute>, its line, the fix

Memory figures (``devicekit/rss_mib`` on CPU; ``devicekit/allocated_mib``, ``reserved_mib``,
``peak_allocated_mib`` on CUDA) go through ``Trainer.log`` on the main process, every
``args.logging_steps`` (or ``log_every``). The leak finder watches the Trainer (``self``, for a
subclass's ``compute_loss``) and the model (``model``), on the main process only. On an
out-of-memory error in a training step or an optimizer step each rank writes its bundle to
``oom_dir/rank<R>/`` and the error goes on. ``find_batch_size(trainer)`` is devicekit's exact
finder: call it before ``trainer.train()`` instead of ``auto_find_batch_size=True``.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devicekit.errors import InvalidValueError, MissingDependencyError
from devicekit.integrations.monitor import TrainingMonitor

try:
    from transformers import Trainer, TrainerCallback
except ImportError:
    raise MissingDependencyError(
        "devicekit.integrations.transformers needs transformers, which is not installed; "
        "pip install 'devicekit[transformers]'"
    ) from None

__all__ = ["DeviceKitCallback", "find_trainer"]

_WRAPPED = "_devicekit_wrapped"


def find_trainer(depth: int = 30) -> Trainer | None:
    """The Trainer whose loop called us: the ``self`` of the nearest ``Trainer`` frame outwards."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


class DeviceKitCallback(TrainerCallback):
    """A ``transformers.TrainerCallback``; options as
    :class:`devicekit.integrations.monitor.TrainingMonitor` (``log_every`` defaults to the
    Trainer's ``logging_steps``)."""

    def __init__(self, *, log_every: int | None = None, leak_check_steps: int | None = 6,
                 leak_check_every: int | None = None, oom_dir: str | Path | None = "devicekit-oom",
                 oom_snapshot: bool = True, prefix: str = "devicekit/") -> None:
        self.monitor = TrainingMonitor(log_every=log_every, leak_check_steps=leak_check_steps,
                                       leak_check_every=leak_check_every, oom_dir=oom_dir,
                                       oom_snapshot=oom_snapshot, prefix=prefix)
        self.batch_size: int | None = None
        self._trainer: Trainer | None = None
        self._interval = 1
        self._wrapped: list[tuple[Any, str, Any]] = []

    @property
    def leak_reports(self) -> list:
        """Every finished leak check (a ``LeakReport`` each), clean ones included."""
        return self.monitor.leak_reports

    @property
    def bundles(self) -> list[Path]:
        """Folders of the OOM bundles this rank wrote."""
        return self.monitor.bundles

    # -- Trainer hooks -------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._trainer = find_trainer()
        self._interval = self.monitor.log_every or _logging_interval(args, state)
        device = next(model.parameters()).device if model is not None else args.device
        self.monitor.begin(rank=int(args.process_index), device=device)
        if self._trainer is not None:
            self._wrap(self._trainer, "training_step")
            if callable(getattr(self._trainer, "get_batch_samples", None)):
                # a failing batch ends train() without on_train_end: the leak window (which pauses
                # automatic garbage collection while it lasts) must end with it
                self._wrap(self._trainer, "get_batch_samples")
        optimizer = kwargs.get("optimizer")
        if optimizer is not None:
            self._wrap(optimizer, "step")

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        step = int(state.global_step)
        holders = {"self": self._trainer, "model": model}
        figures = self.monitor.after_step(step, holders, log=step % self._interval == 0)
        if figures and state.is_world_process_zero and self._trainer is not None:
            # Trainer.log clears control.should_log, which would skip the Trainer's own logging
            # step on this rank only, and with it a collective the other ranks then wait in
            should_log = control.should_log
            self._trainer.log(figures)
            control.should_log = should_log

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.monitor.end()
        self._unwrap()

    # -- OOM -----------------------------------------------------------------------------------
    def _wrap(self, owner: Any, name: str) -> None:
        """Catch errors of ``owner.name`` (an instance attribute shadows the method)."""
        original = getattr(owner, name)
        if getattr(original, _WRAPPED, False):
            return
        monitor, callback = self.monitor, self

        @functools.wraps(original)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except Exception as exc:
                monitor.on_error(exc)
                callback._unwrap()  # the error ends train(); a retry wraps again at its start
                raise

        setattr(guarded, _WRAPPED, True)
        self._wrapped.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, guarded)

    def _unwrap(self) -> None:
        for owner, name, own in reversed(self._wrapped):
            if own is None:
                vars(owner).pop(name, None)  # the class's method again
            else:
                setattr(owner, name, own)
        self._wrapped.clear()

    # -- batch size ----------------------------------------------------------------------------
    def find_batch_size(self, trainer: Trainer, *, start: int = 2, minimum: int = 1,
                        maximum: int | None = None, multiple_of: int = 1) -> int:
        """The largest per-device batch size whose training step fits; sets it on the Trainer.

        Each trial collates ``n`` examples of ``trainer.train_dataset`` with the Trainer's data
        collator and runs ``trainer.compute_loss`` and backward. The answer is exact (doubling,
        then bisection, where ``auto_find_batch_size`` shrinks by a factor and may undershoot),
        the same on every rank of a distributed run, and becomes
        ``args.per_device_train_batch_size``. Optimizer state is not part of a trial: leave room.
        """
        import devicekit as dk

        if not isinstance(trainer, Trainer):
            raise InvalidValueError(f"find_batch_size needs the transformers.Trainer, got {type(trainer).__name__}")
        data = trainer.train_dataset
        if data is None or not hasattr(data, "__getitem__") or not hasattr(data, "__len__") or len(data) == 0:
            raise InvalidValueError("find_batch_size needs a train_dataset with examples that can be indexed")
        model = trainer.model
        collate: Callable[[list[Any]], Any] = trainer.data_collator
        device = next(model.parameters()).device
        was_training = model.training
        model.train()

        def trial(n: int) -> None:
            examples = [data[i % len(data)] for i in range(n)]
            inputs = dk.to_device(collate(examples), device)
            loss = trainer.compute_loss(model, inputs)
            if isinstance(loss, tuple):
                loss = loss[0]
            loss.backward()
            model.zero_grad(set_to_none=True)

        try:
            found = int(dk.find_batch_size(trial, start=start, minimum=minimum, maximum=maximum,
                                           multiple_of=multiple_of))
        finally:
            model.train(was_training)
        trainer.args.per_device_train_batch_size = found
        if hasattr(trainer, "_train_batch_size"):
            trainer._train_batch_size = trainer.args.train_batch_size
        self.batch_size = found
        return found


def _logging_interval(args: Any, state: Any) -> int:
    """The Trainer's logging interval in steps (``logging_steps`` below 1 is a share of the run)."""
    steps = getattr(args, "logging_steps", 500) or 500
    if isinstance(steps, float) and steps < 1:
        steps = math.ceil((getattr(state, "max_steps", 0) or 1) * steps)
    return max(int(steps), 1)
