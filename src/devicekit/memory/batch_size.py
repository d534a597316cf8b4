"""Find the largest batch size that fits: grow by doubling, then bisect to the exact limit.

``fn(batch_size)`` runs one representative step (forward and backward of the biggest batch).
Sizes double from ``start`` until one fails with an out-of-memory error (or ``maximum`` fits),
then the finder bisects between the last size that fit and the first that failed, so it returns
the largest size that fits (given that memory use grows with the batch size), in O(log n)
trials. Unlike a 0.9x shrink loop it never undershoots, and it stops with a clear
:class:`~devicekit.errors.BatchSizeError` when even ``minimum`` does not fit. Between trials the
failed trial's frames are cleared and cached blocks are returned, so no tensor of a failed
trial survives. Only OOM errors mean "too big"; any other error propagates at once. In a
distributed run every rank takes part in every decision (``all_reduce(MIN)``), so all ranks
return the same, smallest, answer. With ``key`` the answer is cached in a JSON file.

Usage::

    import devicekit as dk

    def trial(n):
        x = torch.randn(n, 3, 224, 224, device="cuda")
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)

    bs = dk.find_batch_size(trial, start=16, maximum=1024, key="resnet50-224")
    print(bs, bs.trials)          # 181 [Trial(16, fits=True, ...), ...]
"""

from __future__ import annotations

import gc
import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from devicekit.errors import BatchSizeError, InvalidValueError
from devicekit.memory.batch_size_cache import read_cached, write_cached
from devicekit.memory.oom_message import is_oom

__all__ = ["BatchSize", "Trial", "find_batch_size"]

log = logging.getLogger("devicekit.memory.batch_size")
#: without ``maximum``, growth stops here (a function that never fails would double forever)
GROWTH_LIMIT = 1 << 24


@dataclass(frozen=True)
class Trial:
    batch_size: int
    fits: bool
    seconds: float
    error: str = ""


class BatchSize(int):
    """The answer (an ``int``) with the trials that led to it and whether it came from the cache."""

    trials: list[Trial]
    cached: bool

    def __new__(cls, value: int, trials: list[Trial], cached: bool = False) -> BatchSize:
        obj = super().__new__(cls, value)
        obj.trials = trials
        obj.cached = cached
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (BatchSize, (int(self), self.trials, self.cached))


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidValueError(f"{name}={value!r} must be a whole number >= 1")
    return value


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _all_min(value: int) -> int:
    """The smallest ``value`` over all ranks (``value`` itself outside a distributed run)."""
    if not _distributed():
        return value
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return int(flag.item())


def _agree(fits: bool) -> bool:
    """All ranks fit, or none does: every rank follows the same search."""
    return bool(_all_min(1 if fits else 0))


def _is_main() -> bool:
    if not _distributed():
        return True
    import torch.distributed as dist

    return dist.get_rank() == 0


def _run_trial(fn: Callable[[int], Any], units: int, trials: list[Trial], scale: int) -> bool:
    size = units * scale
    began = time.perf_counter()
    error = ""
    try:
        fn(size)
        fits = True
    except Exception as exc:
        if not is_oom(exc):
            raise
        error = str(exc).strip().split("\n")[0][:200]
        traceback.clear_frames(exc.__traceback__)  # the failed trial's tensors go now
        fits = False
    if not fits:  # a success frees by reference counting; a failure may leave cycles behind
        _free_memory()
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    seconds = time.perf_counter() - began
    local = fits
    fits = _agree(fits)
    if local and not fits:
        error = "fits here, but not on another rank"
    trials.append(Trial(size, fits, seconds, error))
    log.info("batch size %d: %s (%.2f s)%s", size, "fits" if fits else "out of memory", seconds,
             f": {error}" if error else "")
    return fits


def find_batch_size(
    fn: Callable[[int], Any], *, start: int = 32, minimum: int = 1, maximum: int | None = None,
    multiple_of: int = 1, key: str | None = None, cache: str | Path | None = None, refresh: bool = False,
) -> BatchSize:
    """The largest batch size in ``[minimum, maximum]`` for which ``fn(size)`` runs without OOM.

    ``multiple_of``: try only multiples of it (8 for tensor cores): fewer trials, and the answer
    is the largest multiple that fits. ``key``: cache the answer under this name in ``cache`` (default
    ``$XDG_CACHE_HOME/devicekit/batch_size.json``) and return it next time without trials;
    ``refresh=True`` searches again and overwrites it.
    """
    if not callable(fn):
        raise InvalidValueError(f"fn={fn!r} is not callable; pass a function taking the batch size")
    start, minimum = _check_size("start", start), _check_size("minimum", minimum)
    if maximum is not None and _check_size("maximum", maximum) < minimum:
        raise InvalidValueError(f"maximum={maximum} is below minimum={minimum}; raise maximum")
    if start < minimum:
        raise InvalidValueError(f"start={start} is below minimum={minimum}; start at {minimum} or more")
    step = _check_size("multiple_of", multiple_of)
    if start % step:
        raise InvalidValueError(f"start={start} is not a multiple of multiple_of={step}; start at {start // step * step or step}")
    top = (maximum if maximum is not None else GROWTH_LIMIT) // step
    low = -(-minimum // step)
    if top < low:
        raise InvalidValueError(f"no multiple of {step} between minimum={minimum} and maximum={maximum}")
    start_units = min(start // step, top)
    if key is not None and not refresh:
        found = read_cached(key, cache)
        if found is not None and not (minimum <= found <= top * step and found % step == 0):
            log.info("cached batch size %d for %r is outside minimum=%d, maximum=%s, multiple_of=%d; "
                     "searching again", found, key, minimum, maximum, step)
            found = None
        # every rank uses the cache or none does (a rank without it would wait in the search's
        # collectives for ranks that returned at once); where all have it, the smallest wins
        agreed = _all_min(found if found is not None else -1)
        if agreed >= 0:
            log.info("batch size %d for %r from the cache", agreed, key)
            return BatchSize(agreed, [], cached=True)
    gc.collect()  # once, in full; then freeze it so the collection after each failed trial only
    frozen = gc.get_freeze_count() == 0  # looks at objects the trials made (never undo a user freeze)
    if frozen:
        gc.freeze()
    try:
        good = _search(fn, start_units, low, maximum, top, step)
    finally:
        if frozen:
            gc.unfreeze()
    if key is not None and _is_main():
        write_cached(key, good, cache)
    log.info("largest batch size that fits: %d (%d trials)", good, len(good.trials))
    return good


def _search(fn: Callable[[int], Any], start: int, minimum: int, maximum: int | None, top: int,
            scale: int) -> BatchSize:
    """Search in units of ``scale``: doubling from ``start``, halving to ``minimum``, bisecting."""
    trials: list[Trial] = []
    good: int | None = None
    bad: int | None = None
    if _run_trial(fn, start, trials, scale):
        good = start
        while good < top:  # grow
            size = min(good * 2, top)
            if _run_trial(fn, size, trials, scale):
                good = size
            else:
                bad = size
                break
        if bad is None and maximum is None:
            log.warning("batch size %d still fits; stopped growing at the limit %d", good * scale, GROWTH_LIMIT)
    else:
        bad = start
        size = start
        while good is None:  # shrink by halves, never below minimum
            if size == minimum:
                raise BatchSizeError(
                    f"batch size {minimum * scale} (the minimum) does not fit in memory ({trials[-1].error}); "
                    f"free memory (see dk.memory.report()) or lower minimum"
                )
            size = max(size // 2, minimum)
            if _run_trial(fn, size, trials, scale):
                good = size
            else:
                bad = size
    while bad is not None and bad - good > 1:  # bisect: good fits, bad does not
        middle = (good + bad) // 2
        if _run_trial(fn, middle, trials, scale):
            good = middle
        else:
            bad = middle
    return BatchSize(good * scale, trials)
