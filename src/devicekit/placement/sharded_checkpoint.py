"""Sharded checkpoints: models split over ranks (FSDP2 ``DTensor`` parameters) through DCP.

``dk.save_checkpoint`` sends here whatever holds a sharded tensor: an FSDP2 module, its
``state_dict()``, or a dict holding either. Every rank writes its own shards into a
``torch.distributed.checkpoint`` directory (first into a temporary directory next to it, then
renamed by rank 0, so a crash leaves the previous checkpoint whole). ``dk.load_checkpoint``
recognises such a directory; with ``into=model`` (sharded over any number of ranks, or a plain
model in one process) it loads in place, resharding as needed; without it, one process gets
the full state as plain tensors.

Usage::

    dk.save_checkpoint(model, "ckpt/step-100")              # every rank calls it
    dk.load_checkpoint("ckpt/step-100", into=model)         # 1, 2 or 4 ranks, sharded or not
    state = dk.load_checkpoint("ckpt/step-100")             # one process: {name: tensor}
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from devicekit.errors import CheckpointError

__all__ = ["holds_sharded", "is_sharded_checkpoint", "save_sharded", "load_sharded"]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def _state(obj: Any) -> Any:
    """Modules replaced by their state dicts (recursively through dicts)."""
    if isinstance(obj, nn.Module):
        return obj.state_dict()
    if isinstance(obj, dict):
        return {k: _state(v) for k, v in obj.items()}
    return obj


def holds_sharded(obj: Any) -> bool:
    """Whether ``obj`` holds a DTensor (a sharded model, its state dict, or a dict of them)."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return False
    if isinstance(obj, nn.Module):
        return any(isinstance(p, dtensor) for p in obj.parameters())
    if isinstance(obj, dict):
        return any(isinstance(v, dtensor) or holds_sharded(v) for v in obj.values())
    return False


def is_sharded_checkpoint(path: Path) -> bool:
    """A directory written by ``torch.distributed.checkpoint`` (it has a ``.metadata`` file)."""
    return path.is_dir() and (path / ".metadata").is_file()


def _rank_and_barrier() -> tuple[int, Any]:
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.barrier
    return 0, lambda: None


def save_sharded(obj: Any, path: Path) -> Path:
    """Every rank writes its shards of ``obj`` into the directory ``path`` (replaced whole)."""
    import torch.distributed.checkpoint as dcp

    rank, barrier = _rank_and_barrier()
    staging = path.parent / f".{path.name}.dcp-tmp"
    if path.exists() and not is_sharded_checkpoint(path):
        raise CheckpointError(f"checkpoint path {str(path)!r} exists and is not a sharded checkpoint "
                              "directory; pass a new directory name")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    try:
        dcp.save(_state(obj), checkpoint_id=str(staging))
    except Exception as exc:
        raise CheckpointError(f"cannot write sharded checkpoint {str(path)!r}: {exc}") from exc
    barrier()
    if rank == 0:
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old-"))
            os.replace(path, old / "x")
        os.replace(staging, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return path


def load_sharded(path: Path, into: Any = None) -> Any:
    """Load the DCP directory ``path`` in place into ``into`` (a module or dict), or whole.

    The metadata is read through an allow-list, data files only as regular files inside the
    directory (no links, FIFOs or devices) and no further than the metadata allows, and
    non-tensor items with ``weights_only`` (:mod:`devicekit.placement.safe_dcp`): a malicious
    directory is refused in one line, never run, never a hang.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from devicekit.placement.safe_dcp import (
        SafeEmptyLoadPlanner,
        SafeLoadPlanner,
        SafeReader,
        check_storage,
        read_metadata,
    )

    metadata = read_metadata(path / ".metadata")  # refused here, before DCP (which logs and
    check_storage(metadata, path)                   # retries); SafeReader checks as it reads
    state: Any = {} if into is None else _state(into)
    planner = SafeEmptyLoadPlanner() if into is None else SafeLoadPlanner()
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
            warnings.simplefilter("ignore", UserWarning)
            if into is None:  # as torch's dcp_to_torch_save does, with the safe reader
                from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

                _load_state_dict(state, storage_reader=SafeReader(str(path), metadata=metadata),
                                 planner=planner, no_dist=True)
            else:
                dcp.load(state, storage_reader=SafeReader(str(path), metadata=metadata),
                         planner=planner)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException: a BaseException
        inner = _devicekit_cause(exc)
        if inner is not None:  # DCP wraps errors raised on a rank in CheckpointException
            raise inner from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        target = "" if into is None else f" into {type(into).__name__}"
        raise CheckpointError(f"cannot load sharded checkpoint {str(path)!r}{target}: {first}") from exc
    if into is None:
        return state
    _apply(into, state)
    return into


def _devicekit_cause(exc: BaseException) -> CheckpointError | None:
    """The CheckpointError DCP caught on a rank and wrapped (its ``failures``), if any."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            found = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(found, CheckpointError):
                return found
    seen = exc.__cause__ or exc.__context__
    return seen if isinstance(seen, CheckpointError) else None


def _apply(target: Any, state: Any) -> None:
    if isinstance(target, nn.Module):
        target.load_state_dict(state)
    elif isinstance(target, dict):
        for key, value in target.items():
            if isinstance(value, (nn.Module, dict)):
                _apply(value, state[key])
            else:
                target[key] = state[key]
