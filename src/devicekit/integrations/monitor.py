"""The framework-neutral part of the callbacks: what to do after a step and on an error.

Both :class:`devicekit.integrations.lightning.DeviceKitCallback` and
:class:`devicekit.integrations.transformers.DeviceKitCallback` drive one :class:`TrainingMonitor`;
they only translate their framework's hooks into :meth:`~TrainingMonitor.begin`,
:meth:`~TrainingMonitor.after_step`, :meth:`~TrainingMonitor.on_error` and
:meth:`~TrainingMonitor.end`, and hand the returned figures to their framework's logger.

Per step it costs one counter unless the step is logged (a few host-side reads, no device
synchronisation) or inside a leak-check window (rank 0 only). Nothing here talks to other ranks.

Usage::

    monitor = TrainingMonitor(leak_check_steps=6, oom_dir="oom")
    monitor.begin(rank=0, device=torch.device("cpu"))
    for step, batch in enumerate(loader, 1):
        try:
            train_step(batch)
        except Exception as exc:
            monitor.on_error(exc)        # an OOM: the bundle is written; then re-raise
            raise
        figures = monitor.after_step(step, {"self": module}, log=step % 50 == 0)
    monitor.end()
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from devicekit.errors import InvalidValueError
from devicekit.integrations.leak_watch import LeakWatch, check_steps
from devicekit.integrations.oom_bundle import write_oom_bundle
from devicekit.integrations.step_memory import StepMemory
from devicekit.memory.leaks import LeakReport
from devicekit.memory.oom import attach_oom_observer
from devicekit.memory.oom_message import is_oom

__all__ = ["TrainingMonitor"]

log = logging.getLogger("devicekit.integrations")


class TrainingMonitor:
    """Memory logging, leak checks and OOM bundles for one training run; see the module docstring.

    ``log_every``: log memory every N steps (None: the framework's own logging interval).
    ``leak_check_steps``: steps the leak finder watches from the first step (None or 0: off).
    ``leak_check_every``: start another leak check every M steps. ``oom_dir``: where OOM bundles
    go (None: no bundle). ``oom_snapshot``: on CUDA, record the allocator history from the start
    so an OOM bundle holds a memory_viz snapshot (costs a little per allocation).
    """

    def __init__(self, *, log_every: int | None = None, leak_check_steps: int | None = 6,
                 leak_check_every: int | None = None, oom_dir: str | Path | None = "devicekit-oom",
                 oom_snapshot: bool = True, prefix: str = "devicekit/") -> None:
        self.log_every = check_steps("log_every", log_every)
        self.leaks = LeakWatch(leak_check_steps or None, leak_check_every)
        if oom_dir is not None and not isinstance(oom_dir, (str, Path)):
            raise InvalidValueError(f"oom_dir={oom_dir!r} must be a folder path, or None for no OOM bundle")
        self.oom_dir = Path(oom_dir) if oom_dir is not None else None
        self.oom_snapshot = bool(oom_snapshot)
        if not isinstance(prefix, str):
            raise InvalidValueError(f"prefix={prefix!r} must be a string such as 'devicekit/'")
        self.prefix = prefix
        self.rank = 0
        self.step = 0
        self.memory: StepMemory | None = None
        self.bundles: list[Path] = []
        self._recording = False

    @property
    def leak_reports(self) -> list[LeakReport]:
        """Every finished leak check, clean ones included."""
        return self.leaks.reports

    def begin(self, *, rank: int, device: torch.device | str | None) -> None:
        """Training starts on ``rank``, with the model on ``device``."""
        self.leaks.abandon()  # a window left open by a failed run
        self.rank = rank
        self.memory = StepMemory(device, prefix=self.prefix)
        if self.memory.on_cuda and self.oom_dir is not None:
            attach_oom_observer()
            if self.oom_snapshot and not self._recording:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
                self._recording = True

    def after_step(self, step: int, holders: dict[str, Any], *, log: bool) -> dict[str, float]:
        """After training step ``step`` (1-based): the figures to log (empty when not logged)."""
        self.step = step
        figures: dict[str, float] = {}
        if log and self.memory is not None:
            figures = self.memory.read(step)
        if self.rank == 0 and self.leaks.active(step):
            report = self.leaks.after_step(step, holders)
            if report is not None:
                self.leaks.warn(report, step=step)
                figures[f"{self.prefix}leaks"] = float(len(report.leaks))
        return figures

    def on_error(self, exc: BaseException) -> Path | None:
        """An error ends training: for an OOM, write the bundle (the caller re-raises)."""
        self.leaks.abandon()
        try:
            return self._bundle(exc)
        finally:
            self._stop_recording()  # after the snapshot: training is over

    def _bundle(self, exc: BaseException) -> Path | None:
        if self.oom_dir is None or not is_oom(exc) or getattr(exc, "_devicekit_bundle", None):
            return None
        samples = list(self.memory.samples) if self.memory is not None else []
        snapshot = self._recording
        try:
            folder = write_oom_bundle(exc, self.oom_dir, rank=self.rank, step=self.step + 1,
                                      samples=samples, snapshot=snapshot)
        except Exception as err:  # never replace the OOM with our own failure
            log.error("devicekit: could not write the out-of-memory bundle (%s: %s)", type(err).__name__, err)
            return None
        try:
            exc._devicekit_bundle = folder  # type: ignore[attr-defined]  # one bundle per error
        except (AttributeError, TypeError):
            pass
        self.bundles.append(folder)
        log.error("devicekit: out of memory on rank %d at step %d; report and plot in %s",
                  self.rank, self.step + 1, folder)
        return folder

    def end(self) -> LeakReport | None:
        """Training ended: close an unfinished leak check (its report is returned and warned)."""
        report = self.leaks.finish()
        if report is not None:
            self.leaks.warn(report, step=self.step)
        self._stop_recording()
        return report

    def _stop_recording(self) -> None:
        """Stop the allocator history; what it recorded stays for the snapshot."""
        if self._recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False
