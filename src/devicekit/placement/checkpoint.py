"""Checkpoints that survive crashes and changes of machine.

``save_checkpoint`` writes to a temporary file in the same directory, flushes and fsyncs it,
renames it over the target (``os.replace`` is atomic) and fsyncs the directory: a crash or a
kill at any moment leaves either the old checkpoint or the new one, never half of one. In a
distributed run (``torch.distributed`` initialised) only rank 0 writes and every rank waits for
its outcome, so no rank reads a file that is still being written, and when rank 0 fails every
rank raises.

``load_checkpoint`` maps every tensor onto this process's device by default (the seeds' advice:
without ``map_location`` a checkpoint saved on ``cuda:1`` cannot load on a 1-GPU or CPU-only
machine), and loads with ``weights_only=True`` so a file cannot run code on load.

Usage::

    import devicekit as dk

    dk.save_checkpoint({"model": model.state_dict(), "step": step}, "ckpt/last.pt")
    state = dk.load_checkpoint("ckpt/last.pt")                       # onto this process's device
    state = dk.load_checkpoint("ckpt/last.pt", map_location="cpu")
    state = dk.load_checkpoint("ckpt/last.pt", map_location={"cuda:1": "cuda:0"})
    state = dk.load_checkpoint("trusted.pt", weights_only=False)     # only for files you trust
    dk.save_checkpoint(sharded_model, "ckpt/step-100")   # FSDP2 (dk.shard): a DCP directory
    dk.load_checkpoint("ckpt/step-100", into=model)      # on any number of ranks
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from devicekit.errors import CheckpointError, InvalidDeviceError, UnsafeCheckpointError
from devicekit.placement.devices import as_device
from devicekit.placement.preemption import note_saved
from devicekit.placement.save_faults import disk_full, lock_while_writing, remove_stale_temporaries

__all__ = ["save_checkpoint", "load_checkpoint", "default_map_location"]

MapLocation = str | int | torch.device | dict[str, str] | Callable[..., Any] | None


def _distributed() -> tuple[bool, int]:
    """(initialised, rank) of the default process group."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank()
    return False, 0


def _file_mode(path: Path) -> int:
    """The mode the file gets: the old file's mode if there is one, else 0o666 minus umask."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable; a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomically(obj: Any, path: Path) -> None:
    directory = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"cannot create directory {str(directory)!r} for checkpoint: {err.strerror or err}") from None
    if path.is_dir():
        raise CheckpointError(f"checkpoint path {str(path)!r} is a directory; pass a file path such as {str(path / 'last.pt')!r}")
    mode = _file_mode(path)
    remove_stale_temporaries(path)  # left by a save that was killed: ours, and unlocked
    try:
        fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise CheckpointError(f"cannot write checkpoint {str(path)!r}: {err.strerror or err}") from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            lock_while_writing(handle.fileno())  # tells a later save this file is not debris
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        full = disk_full(err, obj, directory)
        if full is not None:
            raise CheckpointError(f"{full}; the previous checkpoint {str(path)!r} is intact"
                                  if path.exists() else full) from None
        if isinstance(err, (pickle.PicklingError, TypeError, AttributeError)):
            raise CheckpointError(f"cannot save checkpoint {str(path)!r}: an object in it cannot be pickled ({err})") from err
        if isinstance(err, OSError):
            raise CheckpointError(f"cannot write checkpoint {str(path)!r}: {err.strerror or err}") from err
        raise
    _fsync_directory(directory)


def save_checkpoint(obj: Any, path: str | os.PathLike[str]) -> Path:
    """Save ``obj`` with ``torch.save`` atomically; returns the path written.

    In a distributed run only rank 0 writes; then rank 0 tells every rank whether it succeeded
    (a broadcast that is also the barrier), so when rank 0 fails every rank raises
    :class:`CheckpointError`, and none goes on believing the checkpoint exists.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(
            f"checkpoint path {path!r} is a {type(path).__name__}, not a path; pass a str or Path"
        )
    target = Path(path)
    from devicekit.placement.sharded_checkpoint import holds_sharded, save_sharded

    if holds_sharded(obj):  # a model sharded over ranks: every rank writes its shards (DCP)
        written = save_sharded(obj, target)
        note_saved(written)
        return written
    distributed, rank = _distributed()
    if not distributed:
        _write_atomically(obj, target)
        note_saved(target)
        return target
    outcome: list[str | None] = [None]  # rank 0's error, None for success
    try:
        if rank == 0:
            _write_atomically(obj, target)
    except BaseException as exc:
        outcome[0] = str(exc) or type(exc).__name__
        raise
    finally:
        torch.distributed.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise CheckpointError(f"rank 0 could not write checkpoint {str(target)!r}: {outcome[0]}")
    note_saved(target)  # after a preemption signal: devicekit run --requeue may requeue now
    return target


def default_map_location() -> torch.device:
    """This process's device: ``cuda:<current>`` when CUDA is usable, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_map_location(map_location: MapLocation) -> Any:
    if map_location is None:
        return default_map_location()
    if isinstance(map_location, (str, int, torch.device)):
        return as_device(map_location)
    if isinstance(map_location, dict):
        checked: dict[str, str] = {}
        for source, target in map_location.items():
            if not isinstance(source, str):
                raise InvalidDeviceError(
                    f"map_location key {source!r} is not a location string; use keys like 'cuda:1'"
                )
            checked[source] = str(as_device(target))
        return checked
    if callable(map_location):
        return map_location
    raise InvalidDeviceError(
        f"map_location {map_location!r} is not a device, dict or callable; pass e.g. 'cpu' or "
        "{'cuda:1': 'cuda:0'}"
    )


def _first_line(err: BaseException) -> str:
    """The first sentence of an error, for a one-line message."""
    lines = str(err).strip().splitlines()
    if not lines:
        return "the file ends early" if isinstance(err, EOFError) else type(err).__name__
    return lines[0].strip().split(". ")[0].rstrip(".")


def load_checkpoint(
    path: str | os.PathLike[str],
    map_location: MapLocation = None,
    weights_only: bool = True,
    *,
    into: Any = None,
) -> Any:
    """Load a checkpoint, by default onto this process's device and without running code.

    ``map_location``: None (this process's device), a device, a dict ``{"cuda:1": "cuda:0"}``
    or a callable as ``torch.load`` takes it. ``weights_only=False`` unpickles arbitrary
    objects: only for files you trust. A sharded checkpoint (a ``torch.distributed.checkpoint``
    directory, see :mod:`devicekit.placement.sharded_checkpoint`) loads in place ``into`` a model
    sharded over any number of ranks (or a plain one), or whole without ``into``.
    """
    source = Path(path)
    if not source.exists():
        raise CheckpointError(f"checkpoint {str(source)!r} not found; check the path")
    from devicekit.placement.sharded_checkpoint import is_sharded_checkpoint, load_sharded

    if is_sharded_checkpoint(source):
        return load_sharded(source, into)
    if source.is_dir():
        raise CheckpointError(f"checkpoint {str(source)!r} is a directory, not a file")
    if not source.is_file():  # a FIFO would block the read forever, a device never end
        raise CheckpointError(f"checkpoint {str(source)!r} is not a regular file; refused")
    location = _check_map_location(map_location)
    try:
        return torch.load(source, map_location=location, weights_only=weights_only)
    except pickle.UnpicklingError as err:
        text = str(err)
        refused = re.search(r"GLOBAL ([\w.]+)", text)
        if weights_only and refused:
            raise UnsafeCheckpointError(
                f"checkpoint {str(source)!r} holds Python objects that safe loading refuses "
                f"(it references {refused.group(1)}); if you trust this file, load it with "
                "load_checkpoint(path, weights_only=False), or allow the class with "
                f"torch.serialization.add_safe_globals([{refused.group(1)}])"
            ) from None
        raise CheckpointError(
            f"cannot read checkpoint {str(source)!r}: not a torch checkpoint; "
            "the file is truncated or corrupt"
        ) from None
    except OSError as err:  # permissions, I/O errors: the file may be fine
        raise CheckpointError(
            f"cannot read checkpoint {str(source)!r}: {err.strerror or _first_line(err)}"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, IndexError, KeyError,
            TypeError, AttributeError, UnicodeDecodeError, MemoryError, OverflowError) as err:
        # a text file such as /etc/passwd reaches torch's legacy loader: any of these
        text = _first_line(err)
        if "cuda" in text.lower() and "deserialize" in text.lower():
            raise CheckpointError(
                f"checkpoint {str(source)!r} holds tensors for a device this machine lacks ({text}); "
                "pass map_location='cpu' or a dict such as {'cuda:1': 'cuda:0'}"
            ) from None
        raise CheckpointError(
            f"cannot read checkpoint {str(source)!r}: {text}; the file is truncated or corrupt"
        ) from None
