"""Find the newest checkpoint and load it: how a requeued job carries on.

:func:`latest_checkpoint` looks in a directory (or matches a glob pattern) for what
``dk.save_checkpoint`` wrote: files, and sharded checkpoint directories (a ``.metadata``
inside); the temporary files of a save still in progress (``.NAME.*.tmp``) and other hidden
names are never taken. The newest is the one with the latest modification time; equal times go
to the name that sorts last in natural order (``step10`` after ``step9``). :func:`resume` loads
it with ``dk.load_checkpoint`` (this process's device, ``weights_only=True``); if the newest
cannot be read (copied half-way, a disk error) it says so in a warning and takes the one
before, so a bad last file costs one checkpoint, not the run. Nothing found: None (a fresh
start); on a Slurm restart (``SLURM_RESTART_COUNT`` > 0) that is also a warning, since a
requeued job that finds nothing starts over.

Usage::

    import devicekit as dk

    state = dk.resume("ckpt/")                    # None on the first run
    start = state["step"] + 1 if state else 0
    model.load_state_dict(state["model"]) if state else None
    dk.latest_checkpoint("ckpt/step*.pt")         # the Path, or None
"""

from __future__ import annotations

import glob
import os
import re
import warnings
from pathlib import Path
from typing import Any

from devicekit.errors import CheckpointError, UnsafeCheckpointError
from devicekit.placement.checkpoint import MapLocation, load_checkpoint

__all__ = ["latest_checkpoint", "checkpoints", "resume", "RESTART_ENV"]

#: Slurm's count of restarts (requeues) of this job
RESTART_ENV = "SLURM_RESTART_COUNT"


def _natural(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _candidate(path: Path) -> bool:
    if path.name.startswith("."):  # a save in progress (.last.pt.x1y2.tmp), or hidden
        return False
    if path.is_file():
        return True
    return path.is_dir() and (path / ".metadata").is_file()  # a sharded (DCP) checkpoint


def checkpoints(where: str | os.PathLike[str]) -> list[Path]:
    """Every checkpoint in directory ``where`` (or matching pattern ``where``), oldest first."""
    text = os.fspath(where)
    if glob.has_magic(text):
        found = [Path(p) for p in glob.glob(text)]
    else:
        root = Path(text)
        if root.is_file() or (root / ".metadata").is_file():
            return [root]
        if not root.is_dir():
            return []
        found = list(root.iterdir())
    stamped = []
    for path in found:
        try:
            if not _candidate(path):
                continue
            stamped.append((path.stat().st_mtime_ns, _natural(path.name), path))
        except OSError:  # removed meanwhile
            continue
    stamped.sort(key=lambda item: (item[0], item[1]))
    return [path for _, _, path in stamped]


def latest_checkpoint(where: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint in directory ``where`` (or matching glob ``where``), or None."""
    found = checkpoints(where)
    return found[-1] if found else None


def resume(where: str | os.PathLike[str], map_location: MapLocation = None,
           weights_only: bool = True, *, into: Any = None) -> Any:
    """Load the newest readable checkpoint in ``where``; None when there is none.

    Arguments after ``where`` are ``dk.load_checkpoint``'s. A checkpoint that cannot be read is
    skipped with a warning naming it and the error; one refused by safe loading
    (:class:`UnsafeCheckpointError`) is raised, never skipped.
    """
    found = checkpoints(where)
    for path in reversed(found):
        try:
            return load_checkpoint(path, map_location, weights_only, into=into)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as exc:
            warnings.warn(f"{exc}; resuming from the checkpoint before it", stacklevel=2)
    restarts = os.environ.get(RESTART_ENV, "0")
    if restarts.isdigit() and int(restarts) > 0:
        what = "no readable checkpoint" if found else "no checkpoint"
        warnings.warn(f"this Slurm job restarted ({RESTART_ENV}={restarts}) but {what} is in"
                      f" {os.fspath(where)!r}: starting from scratch", stacklevel=2)
    return None
