"""Errors devicekit raises, one class per kind of failure.

Every error a user can cause is a :class:`DeviceKitError` whose message is one line that names
the bad value and says what to do. The CLI prints ``devicekit: <message>`` and exits with the
class's ``exit_code``; it never prints a traceback for these.

Usage::

    import devicekit as dk

    try:
        sel = dk.select_gpus(2, min_free_memory="20GiB")
    except dk.NoDeviceAvailable as err:
        print(err)          # "need 2 GPU(s), 1 eligible: GPU 1: 1.2 GiB free < 20 GiB asked"
        print(err.reasons)  # one line per rejected GPU
"""

from __future__ import annotations

__all__ = [
    "DeviceKitError",
    "InvalidValueError",
    "InvalidSizeError",
    "InvalidDeviceError",
    "VisibleDevicesError",
    "SimulationFileError",
    "BackendError",
    "NVMLUnavailableError",
    "NoDeviceAvailable",
    "LeaseError",
    "CheckpointError",
    "UnsafeCheckpointError",
    "PlacementError",
    "SplitError",
    "DistributedError",
    "RankFailedError",
    "RankHangError",
    "BatchSizeError",
    "LaunchError",
    "CommandNotFoundError",
    "GradientMismatchError",
    "MissingDependencyError",
    "ServeError",
    "LeakWarning",
]


class DeviceKitError(Exception):
    """Base class: a problem the user can fix. Its message is one line."""

    #: Exit code the CLI uses for this error (1: bad input).
    exit_code: int = 1

    def cli_message(self) -> str:
        """The message in the command line's words (flags, not keyword arguments)."""
        return str(self)


class InvalidValueError(DeviceKitError, ValueError):
    """A value given by the user is malformed or out of range."""


class InvalidSizeError(InvalidValueError):
    """A byte size such as ``"10XB"`` could not be parsed."""


class InvalidDeviceError(InvalidValueError):
    """A device string or index such as ``"gpu:0"`` or ``"cuda:7"`` is unknown or absent."""


class VisibleDevicesError(InvalidValueError):
    """``CUDA_VISIBLE_DEVICES`` names a GPU that does not exist or cannot be parsed."""


class SimulationFileError(InvalidValueError):
    """The ``DEVICEKIT_SIMULATE`` file is missing, not JSON, or has a bad key."""


class BackendError(DeviceKitError, RuntimeError):
    """The GPU driver or NVML failed while being asked for facts."""

    exit_code = 2


class NVMLUnavailableError(BackendError):
    """NVML (the NVIDIA driver library) cannot be loaded or initialised."""


class NoDeviceAvailable(DeviceKitError, RuntimeError):
    """Fewer GPUs satisfy the request than were asked for.

    ``reasons`` holds one line per GPU that was not chosen. ``waiting_helps`` is False when no
    amount of waiting could satisfy the request (too few GPUs, too little memory on any).
    ``hint`` / ``cli_hint``: what to do, in Python's and in the command line's words.
    """

    exit_code = 3

    def __init__(self, message: str, reasons: list[str] | tuple[str, ...] = (), *,
                 waiting_helps: bool = True, hint: str = "", cli_hint: str = "") -> None:
        super().__init__(f"{message}; {hint}" if hint else message)
        self.summary = message
        self.reasons = list(reasons)
        self.waiting_helps = waiting_helps
        self.cli_hint = cli_hint or hint

    def cli_message(self) -> str:
        return f"{self.summary}; {self.cli_hint}" if self.cli_hint else self.summary


class LeaseError(DeviceKitError, RuntimeError):
    """The lease directory is unusable (wrong owner, a symlink, not writable)."""


class CheckpointError(DeviceKitError, RuntimeError):
    """A checkpoint could not be written or read."""


class UnsafeCheckpointError(CheckpointError):
    """The checkpoint holds arbitrary Python objects and ``weights_only`` was not lifted."""


class PlacementError(DeviceKitError, RuntimeError):
    """An object cannot be placed or its device cannot be told (e.g. spread over devices)."""


class SplitError(PlacementError):
    """A model cannot be split across devices as asked."""


class DistributedError(DeviceKitError, RuntimeError):
    """The distributed set-up is inconsistent (ranks, master address, backend)."""


class LaunchError(DistributedError):
    """Processes could not be started or supervised."""


class CommandNotFoundError(LaunchError):
    """The command given to ``devicekit run`` cannot be started; exits 127 like a shell."""

    exit_code = 127


class RankFailedError(DistributedError):
    """A rank of a launched job raised; carries the rank and its original traceback."""

    def __init__(self, message: str, rank: int, traceback_text: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback_text = traceback_text

    def __str__(self) -> str:  # the first line stays the one-line message
        base = super().__str__()
        if self.traceback_text:
            return f"{base}\n\n--- traceback of rank {self.rank} ---\n{self.traceback_text.rstrip()}"
        return base


class RankHangError(DistributedError):
    """The hang watchdog fired: some rank made no progress within the timeout."""

    def __init__(self, message: str, stuck_ranks: list[int], stacks: dict[int, str],
                 report: str = "") -> None:
        super().__init__(message)
        self.stuck_ranks = stuck_ranks
        self.stacks = stacks
        #: the hang doctor's report: who waits in which collective, who never came
        self.report = report

    def __str__(self) -> str:  # the first line stays the one-line message
        base = super().__str__()
        return f"{base}\n\n{self.report.rstrip()}" if self.report else base


class BatchSizeError(DeviceKitError, RuntimeError):
    """No batch size down to ``minimum`` fits in memory."""


class GradientMismatchError(DistributedError):
    """A parallel set-up's gradients differ from the single-process reference.

    ``report`` is the :class:`devicekit.strategy.equivalence.EquivalenceReport` with the
    per-parameter differences and the diagnosis.
    """

    def __init__(self, message: str, report: object) -> None:
        super().__init__(message)
        self.report = report


class MissingDependencyError(DeviceKitError, ImportError):
    """An optional extra (e.g. matplotlib for plots) is needed and not installed."""


class ServeError(DeviceKitError, RuntimeError):
    """``devicekit serve`` cannot listen where asked (port in use, unknown host, no permission)."""


class LeakWarning(UserWarning):
    """A training loop keeps memory that grows every step (issued by the framework callbacks).

    A warning, not an error: training goes on. The message names the holder, the line that grew
    it and the fix; ``warnings.simplefilter("error", dk.LeakWarning)`` turns it into a stop.
    """
