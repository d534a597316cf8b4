"""Choose free GPUs and lease them in one atomic step: ``select_gpus``.

The pipeline, each stage one module: the request is checked once (:mod:`.gpu_request`); the machine
is read once (:mod:`.look`); every device is judged against the filters (:mod:`.candidates`:
free memory, utilization, ``exclude``, leases, ``CUDA_VISIBLE_DEVICES``); the fair queue gives
its verdict (:mod:`.queue_verdict`); the survivors are ordered and the best ``count`` leased under
their lock files (:mod:`.ranking`, :mod:`.grant`), so two jobs started at the same instant never
get the same GPU. Every GPU not chosen gets one line in ``Selection.rejected`` saying why. Too
few: :class:`~devicekit.errors.NoDeviceAvailable` with those lines, or with ``wait=`` a ticket
in the fair queue and a look every ``poll_interval`` until enough free up, or with
``fallback="cpu"`` a CPU selection.

Usage::

    import devicekit as dk

    with dk.select_gpus(2, min_free_memory="20GiB", wait=600) as sel:
        print(sel.cuda_visible_devices, sel.rejected)
        model = model.to(sel.devices[0])
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

from devicekit.errors import InvalidValueError, NoDeviceAvailable
from devicekit.hardware.gpu import GPU
from devicekit.selection.candidates import Candidate
from devicekit.selection.gpu_request import Request, make_request
from devicekit.selection.grant import attempt
from devicekit.selection.result import Selection
from devicekit.selection.waiting import WaitDisplay
from devicekit.sharing.policy import parse_duration
from devicekit.sharing.queue_turn import join_for, queued

__all__ = ["select_gpus"]


def select_gpus(count: int | str = 1, *, min_free_memory: str | int | None = None,
                max_utilization: float | str | None = None,
                exclude: Iterable[int | str] | int | str = (), order: str = "free-memory",
                wait: float | None = None, lease: bool = True, fallback: str | None = None,
                account_as_free: Iterable[str] | str = (), share: bool = False,
                poll_interval: float = 1.0, progress: bool | None = None,
                command: str | None = None, time_limit: float | str | None = None,
                gpus: Sequence[GPU] | None = None) -> Selection:
    """Choose ``count`` GPUs (``"all"``: every eligible one) and lease them.

    ``min_free_memory``: a size (``"20GiB"``) each GPU must have free; with ``share=True`` it is
    also the memory budget this lease claims, and several share leases may sit on one GPU while
    their budgets fit. ``max_utilization``: percent busy at most. ``exclude``: indices or UUIDs.
    ``order``: ``"free-memory"`` (most first), ``"utilization"`` (idlest first), ``"fastest"``
    (strongest first by :mod:`~devicekit.hardware.capability` score, then most free; the chosen
    GPUs come back in that order, so ``cuda:0`` is the strongest), ``"index"`` or ``"random"``.
    ``account_as_free``: users whose processes' GPU memory counts as free (your own
    idle notebook). ``wait``: seconds to poll (every ``poll_interval`` s) for enough GPUs; while
    it waits, ``progress`` None or True shows a live line on a terminal and plain lines on stderr
    elsewhere (the ticket, its place, why it waits; again on each change and every 30 s; see
    :mod:`~devicekit.selection.waiting`), False nothing. ``lease=False``: choose without
    reserving (still skips leased GPUs). ``fallback="cpu"``: return a CPU selection instead of
    raising :class:`~devicekit.errors.NoDeviceAvailable`. ``command``: recorded in the lease.
    Waiting takes a ticket in the fair queue (first come, first served; GPUs reserved for the
    head; see :mod:`~devicekit.sharing.queue_order`). ``time_limit`` (``"30m"``): the job's
    declared limit, which lets it be backfilled onto reserved GPUs; ``devicekit run --time``
    enforces it (a caller of ``select_gpus`` promises to release the GPUs by then).
    ``gpus``: an inventory snapshot already taken (the first look uses it instead of a new one).
    """
    request = make_request(count, min_free_memory=min_free_memory,
                           max_utilization=max_utilization, exclude=exclude, order=order,
                           account_as_free=account_as_free, share=share)
    if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float))
                             or not math.isfinite(wait) or wait < 0):
        raise InvalidValueError(f"wait {wait!r} must be a number of seconds >= 0")
    if fallback not in (None, "cpu"):
        raise InvalidValueError(f"fallback {fallback!r} must be None or 'cpu'")
    if isinstance(poll_interval, bool) or not isinstance(poll_interval, (int, float)) \
            or not poll_interval > 0:
        raise InvalidValueError(f"poll_interval {poll_interval!r} must be a number of seconds > 0")
    limit = parse_duration(time_limit, name="time_limit") if time_limit is not None else None
    start = time.monotonic()
    deadline = start + (wait or 0.0)
    display: WaitDisplay | None = None
    ticket = None
    try:
        while True:
            selection, candidates, look = attempt(request, lease=lease, command=command,
                                                  ticket=ticket, gpus=gpus)
            gpus = None  # a later look takes a fresh snapshot
            if selection is not None:
                limit = _planned_limit(limit, ticket)
                selection.time_limit = limit
                return queued(selection, ticket, limit, command, look.directory, look.policy)
            now = time.monotonic()
            if wait is None or now >= deadline or not _waiting_helps(candidates, request):
                break
            if ticket is None and request.count is not None and not request.share:
                ticket = join_for(request, candidates, command, limit, look.directory, look.policy)
            if display is None:
                display = WaitDisplay(request.count, wait, enabled=progress)
            display.update(candidates, deadline - now, ticket=ticket, look=look)
            time.sleep(min(poll_interval, max(deadline - now, 0.0)))
    except BaseException:
        if ticket is not None:
            ticket.close()
        raise
    finally:
        if display is not None:
            display.close()
    if ticket is not None:
        ticket.close()
    error = _shortfall(request, candidates, look.no_gpu_reason(), wait)
    if fallback == "cpu":
        return Selection([], [*error.reasons, f"falling back to cpu: {error.summary}"], None,
                         cpu_fallback=True)
    raise error


def _planned_limit(declared: float | None, ticket: Any) -> float | None:
    """The limit to hold the job to: the one the queue planned with. A waiter's ticket file is
    its owner's to rewrite; a shorter limit there got it backfilled, so that one holds."""
    if ticket is None:
        return declared
    on_file = ticket.time_limit_on_file()
    if on_file is not None and (declared is None or on_file < declared):
        return on_file
    return declared


def _waiting_helps(candidates: Sequence[Candidate], request: Request) -> bool:
    """Whether enough GPUs could qualify once busy ones free up (else waiting is pointless)."""
    return sum(c.possible for c in candidates) >= (request.count or 1)


def _shortfall(request: Request, candidates: Sequence[Candidate], empty: str,
               wait: float | None) -> NoDeviceAvailable:
    """The error for too few GPUs: why, whether waiting could help, and what to do."""
    asked = "at least 1" if request.count is None else str(request.count)
    eligible = sum(c.eligible for c in candidates)
    if not candidates:
        reason = empty or "no GPUs found"
        return NoDeviceAvailable(f"need {asked} GPU(s) but {reason}; waiting cannot help",
                                 [reason], waiting_helps=False)
    if not _waiting_helps(candidates, request):
        possible = sum(c.possible for c in candidates)
        lasting = [f"{c.gpu.label}: {'; '.join(c.lasting)}" for c in candidates if c.lasting]
        if lasting:
            message = (f"need {asked} GPU(s) but only {possible} of the {len(candidates)} GPU(s)"
                       f" here could ever qualify: {'; '.join(lasting)}; waiting cannot help")
        else:
            message = (f"need {asked} GPU(s) but this machine has only {len(candidates)};"
                       " waiting cannot help")
        return NoDeviceAvailable(message, lasting, waiting_helps=False,
                                 hint="ask for fewer GPUs or relax the limits")
    reasons = [c.line() for c in candidates if not c.eligible]
    waited = f" after waiting {wait:g} s" if wait else ""
    message = f"need {asked} GPU(s), {eligible} eligible now{waited}: {'; '.join(reasons)}"
    if wait:
        return NoDeviceAvailable(message, reasons, hint="wait longer or relax the limits")
    return NoDeviceAvailable(
        message, reasons,
        hint="pass wait=SECONDS to queue until they free up, or relax the limits",
        cli_hint="add --wait SECONDS to queue until they free up, or relax the limits")
