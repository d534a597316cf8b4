"""The fair queue's decision: first come, first served, reservations for the head, EASY backfill.

Pure (no I/O, no clock of its own): every waiter computes the same answer from the same shared
state, so the queue needs no daemon. Tickets are taken in order (higher policy priority first,
then arrival). Each ticket takes the free GPUs it can use that no earlier ticket holds; when
that makes its count it is *granted* them, otherwise it *reserves* them (no later ticket may
take them) and waits for busy ones to free up. A later ticket with a time limit may take
reserved GPUs when its limit ends before the reserving ticket could start (Slurm's EASY
backfill); the reserving ticket's earliest start counts busy GPUs without a known end (no time
limit) as freeing at once, so a backfill never delays it. A ticket beyond its user's quota
reserves nothing and waits with a ``Quota`` reason while others start.

Times are ``time.monotonic()`` seconds (one clock for every process of the machine): changing
the wall clock reorders nothing and moves no deadline.

Usage::

    from devicekit.sharing.queue_order import Busy, Waiting, decide

    waiting = [Waiting("1", "alice", 4, frozenset(gpus)), Waiting("2", "bob", 1, frozenset(gpus))]
    busy = {gpus[0]: Busy("held by carol since 14:02", "carol", ends=None)}
    for d in decide(waiting, gpus, busy, now=0.0):
        print(d.ticket, d.grant, d.reserved, d.reason)   # "1" reserves 3; "2": Reserved for 1
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Waiting", "Busy", "Decision", "decide"]


@dataclass(frozen=True)
class Waiting:
    """One waiting ticket, as the decision needs it."""

    ticket: str
    user: str
    count: int
    #: GPUs (uuids) this request could use once free: its filters applied to free GPUs
    usable: frozenset[str]
    #: seconds the job declares it will run at most (None: no limit, so no backfill)
    time_limit: float | None = None
    #: policy priority (higher first); arrival order breaks ties
    priority: float = 0.0
    #: why too few GPUs pass the filters (``"no GPU with 40 GiB free"``), for its reason
    filter_note: str = ""


@dataclass(frozen=True)
class Busy:
    """A held GPU: who holds it (for reasons) and when it is free at the latest."""

    describe: str
    user: str
    #: monotonic time by which its holder's time limit frees it; None: unknown (no limit)
    ends: float | None = None


@dataclass(frozen=True)
class Decision:
    """What one ticket may do now."""

    ticket: str
    #: GPUs it may lease now (exactly its count), or ()
    grant: tuple[str, ...] = ()
    #: free GPUs held for it (no later ticket may take them, save a backfill)
    reserved: tuple[str, ...] = ()
    #: True when the grant uses GPUs reserved for an earlier ticket (EASY backfill)
    backfill: bool = False
    #: why it waits ("" when granted): Reserved for / Busy / Quota / Filter
    reason: str = ""
    #: earliest monotonic time it could start as far as known limits tell (None: unknown)
    could_start: float | None = field(default=None, compare=False)


def decide(waiting: Sequence[Waiting], gpus: Sequence[str], busy: Mapping[str, Busy],
           now: float, *, max_gpus_per_user: int | None = None,
           user_limits: Mapping[str, int] | None = None,
           labels: Mapping[str, str] | None = None) -> list[Decision]:
    """Decide every ticket of ``waiting`` (given in arrival order) against the GPUs ``gpus``.

    ``busy``: the held GPUs. ``max_gpus_per_user`` / ``user_limits``: quotas (GPUs held plus
    asked). ``labels``: ``uuid -> "GPU 2"`` for reasons. Returns decisions in queue order.
    """
    labels = labels or {}
    user_limits = user_limits or {}
    order = sorted(range(len(waiting)), key=lambda i: (-waiting[i].priority, i))
    free = [u for u in gpus if u not in busy]
    taken: set[str] = set()          # granted in this round
    claimed: dict[str, str] = {}     # free GPU -> ticket that reserves it
    shadow: dict[str, float | None] = {}
    using = _held_per_user(busy)
    out: list[Decision] = []

    def label(uuid: str) -> str:
        return labels.get(uuid, uuid)

    for i in order:
        w = waiting[i]
        limit = user_limits.get(w.user, max_gpus_per_user)
        if limit is not None and using.get(w.user, 0) + w.count > limit:
            out.append(Decision(w.ticket, reason=f"Quota: {w.user} uses {using.get(w.user, 0)} of"
                                f" {limit} GPU(s), asks {w.count}"))
            continue
        if len(w.usable) < w.count:
            note = w.filter_note or f"only {len(w.usable)} GPU(s) pass its filters"
            out.append(Decision(w.ticket, reason=f"Filter: {note}"))
            continue
        mine = [u for u in free if u in w.usable and u not in taken and u not in claimed]
        if len(mine) >= w.count:
            grant = tuple(mine[: w.count])
            taken.update(grant)
            using[w.user] = using.get(w.user, 0) + w.count
            out.append(Decision(w.ticket, grant=grant, could_start=now))
            continue
        if w.time_limit is not None:  # EASY backfill: done before the reserving ticket could start
            fits = [u for u in free if u in w.usable and u not in taken and u in claimed
                    and _before(now + w.time_limit, shadow[claimed[u]])]
            if len(mine) + len(fits) >= w.count:
                grant = tuple((mine + fits)[: w.count])
                taken.update(grant)
                using[w.user] = using.get(w.user, 0) + w.count
                out.append(Decision(w.ticket, grant=grant, backfill=True, could_start=now))
                continue
        for u in mine:
            claimed[u] = w.ticket
        start = _earliest_start(w, len(mine), busy, now)
        shadow[w.ticket] = start
        out.append(Decision(w.ticket, reserved=tuple(mine),
                            reason=_reason(w, mine, gpus, free, claimed, taken, busy, label),
                            could_start=start))
    return out


def _before(end: float, start: float | None) -> bool:
    """Whether a job ending at ``end`` is done by ``start`` (None: could start at once: never)."""
    return start is not None and end <= start


def _held_per_user(busy: Mapping[str, Busy]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for b in busy.values():
        counts[b.user] = counts.get(b.user, 0) + 1
    return counts


def _earliest_start(w: Waiting, have: int, busy: Mapping[str, Busy], now: float) -> float | None:
    """When ``w`` could start at the earliest (None: at any moment): the time its ``need``-th
    busy GPU frees, where a GPU without a known end (no time limit) may free at once."""
    ends = sorted(now if b.ends is None else b.ends for u, b in busy.items() if u in w.usable)
    need = w.count - have
    if need <= 0 or len(ends) < need:  # short of GPUs an earlier ticket holds: not known
        return None
    start = ends[need - 1]
    return start if start > now else None


def _reason(w: Waiting, mine: list[str], gpus: Sequence[str], free: list[str],
            claimed: Mapping[str, str],
            taken: set[str], busy: Mapping[str, Busy], name: Callable[[str], str]) -> str:
    blocked = [u for u in free if u in w.usable and u not in mine and u in claimed]
    if blocked:
        others = sorted({claimed[u] for u in blocked}, key=lambda t: (len(t), t))
        return f"Reserved for {', '.join(others)}: {', '.join(name(u) for u in blocked)}"
    held = [u for u in gpus if u in w.usable and u in busy]  # in GPU order: a stable reason
    have = f" (holds {len(mine)} of {w.count})" if mine else ""
    grabbed = [u for u in free if u in w.usable and u in taken]
    if held:
        first = sorted(held, key=lambda u: (busy[u].ends is None, busy[u].ends or 0.0))[0]
        return f"Busy: {name(first)} {busy[first].describe}{have}"
    if grabbed:
        return f"Busy: {name(grabbed[0])} goes to an earlier ticket{have}"
    return f"Busy: waiting for GPUs{have}"
