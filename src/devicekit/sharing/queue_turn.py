"""A requester's place in the fair queue: join it, learn which GPUs it may take, leave it.

``select_gpus`` calls these (:mod:`devicekit.selection.queue_verdict` and ``select``): every request first keeps away from GPUs reserved for a waiting
ticket (:func:`blocked` with no ticket); a waiting request (``wait=``) that cannot be served at
once :func:`join`\\ s the queue, then on each look may take only what its ticket is granted; a
job with a time limit keeps a ``running`` ticket for as long as it holds its GPUs
(:func:`mark_running`), so that others may be backfilled before it ends.

Usage::

    from devicekit.sharing.queue_turn import blocked, join, mark_running

    why = blocked(directory, devices, leases, None)        # {uuid: "reserved for ticket 3 ..."}
    ticket = join(directory, count=2, candidates=uuids, min_free=None, max_util=None,
                  filters="", command="python train.py", time_limit=None, grace=10.0)
    why = blocked(directory, devices, leases, ticket)      # all but its grant, with its reason
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from devicekit.errors import NoDeviceAvailable
from devicekit.hardware.gpu import GPU
from devicekit.sharing.lease_directory import lease_dir, user_name
from devicekit.sharing.lease_records import LeaseRecord, current_command
from devicekit.sharing.policy import Policy, load_policy
from devicekit.sharing.queue_state import look
from devicekit.sharing.tickets import Ticket, read_tickets

__all__ = ["join", "join_for", "blocked", "mark_running", "queued", "quota_left"]


def join(directory: Path, *, count: int, candidates: Sequence[str], min_free: int | None,
         max_util: float | None, filters: str, command: str, time_limit: float | None,
         grace: float) -> Ticket:
    """Take a ticket at the end of the queue."""
    return Ticket.take(directory, {
        "count": count, "candidates": list(candidates), "min_free": min_free,
        "max_util": max_util, "filters": filters, "command": command,
        "time_limit": time_limit, "grace": grace,
    })


def blocked(directory: Path, devices: Sequence[GPU], leases: Sequence[LeaseRecord],
            ticket: Ticket | None, count: int | None = None, *,
            policy: Policy | None = None) -> dict[str, str]:
    """Devices this requester (asking ``count`` GPUs) may not take now, each with why.

    Without a ticket: every device when the policy's quota forbids ``count`` more, else those
    reserved for (or being started by) a waiting ticket. With one: every device outside its
    grant. Raises :class:`NoDeviceAvailable` when the ticket was cancelled. ``policy``: the
    directory's policy when the caller has read it already.
    """
    if ticket is not None and ticket.cancelled():
        if ticket.directory_gone():
            raise NoDeviceAvailable(
                f"the lease directory {str(directory)!r} was removed while ticket {ticket.ticket}"
                " waited in it (nobody cancelled it); the queue's order is lost: run again",
                waiting_helps=False)
        raise NoDeviceAvailable(f"ticket {ticket.ticket} was cancelled ('devicekit queue cancel');"
                                " not waiting any longer", waiting_helps=False)
    policy = load_policy(directory) if policy is None else policy
    if ticket is None:
        over = _over_quota(policy, leases, count)
        if over:
            return {g.uuid: over for g in devices}
    records = read_tickets(directory)
    if not records:
        return {}
    view = look(directory, devices, leases, tickets=records, policy=policy)
    if ticket is None:
        return dict(view.reserved)
    entry = view.entry_at(ticket.path)
    if entry is None:  # our file is unreadable to the decision: wait, never jump the queue
        return {g.uuid: f"ticket {ticket.ticket} is not in the queue yet" for g in devices}
    grant = entry.decision.grant
    if grant:
        given = ", ".join(view.labels.get(u, u) for u in grant)
        why = f"left to the queue: ticket {ticket.ticket} was given {given}"
    else:
        why = f"queue: ticket {ticket.ticket} waits: {entry.decision.reason}"
    return {g.uuid: why for g in devices if g.uuid not in grant}


class Hold:
    """What a leased selection keeps for the queue: its running ticket (a time-limited job) and
    the start of its GPU-hours, added to its user's fair-share usage when it closes."""

    def __init__(self, directory: Path, ticket: Ticket | None, gpus: int,
                 half_life: float | None) -> None:
        self.directory, self.ticket, self.gpus, self.half_life = directory, ticket, gpus, half_life
        self.started = time.monotonic()
        self._pid = os.getpid()
        self.closed = False

    def close(self) -> None:
        if self.closed or os.getpid() != self._pid:
            return
        self.closed = True
        if self.ticket is not None:
            self.ticket.close()
        if self.half_life is not None:
            from devicekit.sharing.fair_share import record_usage

            hours = self.gpus * (time.monotonic() - self.started) / 3600
            record_usage(self.directory, hours, self.half_life)


def _quota(policy: Policy, leases: Sequence[LeaseRecord]) -> tuple[str, int | None, int]:
    """(this user, the GPUs the policy lets them hold or None, the GPUs they hold now)."""
    me = user_name(os.geteuid())
    return me, policy.user_limits.get(me, policy.max_gpus_per_user), \
        len({r.gpu_uuid for r in leases if r.user == me})


def _over_quota(policy: Policy, leases: Sequence[LeaseRecord], count: int | None) -> str:
    """The ``Quota`` reason when this user may not take ``count`` more GPUs ("" when it may)."""
    me, limit, using = _quota(policy, leases)
    if limit is None:
        return ""
    if (count or 1) > limit:
        raise NoDeviceAvailable(
            f"need {count or 1} GPU(s) but the queue policy lets {me} hold {limit} at most;"
            " waiting cannot help", [f"Quota: {me} may hold {limit} GPU(s)"], waiting_helps=False,
            hint="ask for fewer GPUs or ask the admin (policy.toml in the lease directory)")
    if using + (count or 1) <= limit:
        return ""
    return f"Quota: {me} uses {using} of {limit} GPU(s), asks {count or 1}"


def quota_left(policy: Policy, leases: Sequence[LeaseRecord]) -> tuple[int | None, str]:
    """How many more GPUs this user may take under the policy (None: no quota), and the quota
    in words for a reason ("Quota: alice may hold 1 GPU(s), holds 1")."""
    me, limit, using = _quota(policy, leases)
    if limit is None:
        return None, ""
    return max(limit - using, 0), f"Quota: {me} may hold {limit} GPU(s), holds {using}"


def mark_running(directory: Path, ticket: Ticket | None, gpus: Sequence[str], *,
                 time_limit: float | None, grace: float, command: str, count: int) -> Ticket | None:
    """After the GPUs are leased: keep a ``running`` ticket while a time-limited job holds them
    (for backfill), or leave the queue. Returns the ticket to close when the GPUs go back."""
    if time_limit is None:
        if ticket is not None:
            ticket.close()
        return None
    ends = time.monotonic() + time_limit + grace
    running = {"state": "running", "gpus": list(gpus), "ends": ends}
    if ticket is None:
        return Ticket.take(directory, {"count": count, "candidates": list(gpus), "min_free": None,
                                       "max_util": None, "filters": "", "command": command,
                                       "time_limit": time_limit, "grace": grace, **running})
    ticket.update(**running)
    return ticket


def join_for(request: Any, candidates: Sequence[Any], command: str | None,
             limit: float | None, directory: Path | None = None,
             policy: Policy | None = None) -> Ticket:
    """A ticket for ``select_gpus``'s request: the GPUs it could ever use and its filters."""
    words = []
    if request.min_free is not None:
        from devicekit.units import format_size

        words.append(f"--min-free {format_size(request.min_free)}")
    if request.max_util is not None:
        words.append(f"--max-util {request.max_util:g}")
    if request.exclude:
        words.append(f"--exclude {','.join(request.exclude)}")
    directory = lease_dir() if directory is None else directory
    policy = load_policy(directory) if policy is None else policy
    return join(directory, count=request.count or 1,
                candidates=[c.gpu.uuid for c in candidates if c.possible],
                min_free=request.min_free, max_util=request.max_util, filters=" ".join(words),
                command=command if command is not None else current_command(),
                time_limit=limit, grace=policy.time_limit_grace)


def queued(selection: Any, ticket: Ticket | None, limit: float | None, command: str | None,
           directory: Path | None = None, policy: Policy | None = None) -> Any:
    """Once leased: leave the queue, or keep a running ticket while a time-limited job runs."""
    if selection.lease is None:
        if ticket is not None:
            ticket.close()
        return selection
    try:
        directory = lease_dir() if directory is None else directory
        policy = load_policy(directory) if policy is None else policy
        running = mark_running(
            directory, ticket, [g.uuid for g in selection.gpus], time_limit=limit,
            grace=policy.time_limit_grace,
            command=command if command is not None else current_command(),
            count=len(selection.gpus))
        if running is not None or policy.fair_share_half_life is not None:
            selection.ticket = Hold(directory, running, len(selection.gpus),
                                    policy.fair_share_half_life)
    except BaseException:
        selection.release()
        raise
    return selection
