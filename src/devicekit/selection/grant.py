"""One pass of the pipeline: look -> filters -> the queue's verdict -> order -> lease.

:func:`attempt` reads the machine once (:mod:`.look`), judges every device (:mod:`.candidates`),
applies the queue's verdict (:mod:`.queue_verdict`), orders the eligible ones (:mod:`.ranking`) and
locks the chosen devices one by one (:class:`~devicekit.sharing.leases.Lease`). Locks are tried
in order of preference without waiting: a device taken by someone else a moment earlier is
skipped for the next; when too few can be had, everything taken is given back and the choice is
made again from fresh leases (a few times), so two requests never wait on each other and a
partial grant never leaks.

Usage::

    from devicekit.selection.grant import attempt
    from devicekit.selection.gpu_request import make_request

    selection, candidates, look = attempt(make_request(2), lease=True, command="python train.py")
    if selection is None:
        print([c.line() for c in candidates if not c.eligible])
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

from devicekit.hardware.gpu import GPU
from devicekit.selection.candidates import Candidate, assess
from devicekit.selection.gpu_request import Request
from devicekit.selection.look import Look, take_look
from devicekit.selection.queue_verdict import apply_verdict
from devicekit.selection.ranking import choose, rank, rejected
from devicekit.selection.result import Selection
from devicekit.sharing.lease_records import LeaseRecord
from devicekit.sharing.leases import Lease
from devicekit.sharing.queue_turn import quota_left

__all__ = ["attempt", "RACE_RETRIES"]

#: reservations that lost a race (a device taken between our look and our lock) look again
RACE_RETRIES = 5


def attempt(request: Request, *, lease: bool, command: str | None, ticket: Any = None,
            gpus: Sequence[GPU] | None = None) -> tuple[Selection | None, list[Candidate], Look]:
    """Choose (and with ``lease``, lease) devices for ``request`` from one look at the machine.

    ``gpus``: an inventory snapshot the caller already took (else one is taken). Returns the
    selection (None when too few devices qualify), every candidate as judged, and the look.
    """
    look = take_look(gpus, cleanup=lease)
    if not lease:
        candidates = _within_quota(apply_verdict(assess(look, request), look, ticket,
                                                 request.count, squatting=True), look, request)
        chosen = choose(candidates, request)
        selection = (Selection([c.gpu for c in chosen], rejected(candidates, chosen, request))
                     if chosen else None)
        return selection, candidates, look
    for tries in range(RACE_RETRIES):
        if tries:
            time.sleep(random.uniform(0.005, 0.03) * tries)
            look = look.again(cleanup=True)
        candidates = apply_verdict(assess(look, request), look, ticket, request.count)
        candidates = _within_quota(candidates, look, request)
        ranked = rank(candidates, request)
        if len(ranked) < (request.count or 1):
            return None, candidates, look
        by_uuid = {c.gpu.uuid: c for c in ranked}
        held, refused = Lease.take(list(by_uuid), count=request.count, memory=request.min_free,
                                   share=request.share, command=command, directory=look.directory,
                                   judge=_share_judge(look, request) if request.share else None)
        candidates = [c.refused(refused[c.gpu.uuid]) if c.gpu.uuid in refused else c
                      for c in candidates]
        if held is not None:
            chosen = [by_uuid[uuid] for uuid in held.gpu_uuids]
            return Selection([c.gpu for c in chosen], rejected(candidates, chosen, request),
                             held), candidates, look
    return None, candidates, look


def _within_quota(candidates: list[Candidate], look: Look, request: Request) -> list[Candidate]:
    """For ``"all"``: the eligible devices past the user's quota, refused with the quota's
    reason (a count above the quota is refused by the queue's verdict already)."""
    if request.count is not None:
        return candidates
    left, quota = quota_left(look.policy, look.leases)
    ranked = rank(candidates, request)
    if left is None or len(ranked) <= left:
        return candidates
    over = {c.gpu.uuid for c in ranked[left:]}
    return [c.refused(quota) if c.gpu.uuid in over else c for c in candidates]


def _share_judge(look: Look, request: Request) -> Any:
    """For a share request: with the device locked, does its budget still fit? (None: yes)."""
    by_uuid = {g.uuid: g for g in look.devices}

    def judge(uuid: str, live: Sequence[LeaseRecord]) -> str | None:
        (fresh,) = assess(look, request, [by_uuid[uuid]], live)
        return None if fresh.eligible else "; ".join(fresh.reasons)

    return judge
