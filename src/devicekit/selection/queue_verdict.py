"""The queue's verdict: which eligible devices this requester may not take now, and why.

The fair queue (:func:`devicekit.sharing.queue_turn.blocked`) keeps devices reserved for a
waiting ticket away from everyone else, and gives a waiting ticket only its grant; a device
whose lock file another user made unusable (squatting) is never offered either. Both only mark
candidates ineligible: the filters' reasons stand for the rest.

Usage::

    from devicekit.selection.queue_verdict import apply_verdict

    candidates = apply_verdict(assess(look, request), look, ticket=None, count=1)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from devicekit.selection.candidates import Candidate
from devicekit.selection.look import Look
from devicekit.sharing.lock_squatting import blocked_devices
from devicekit.sharing.queue_turn import blocked

__all__ = ["apply_verdict"]


def apply_verdict(candidates: Sequence[Candidate], look: Look, ticket: Any, count: int | None,
                  *, squatting: bool = False) -> list[Candidate]:
    """``candidates`` with the ones the queue keeps from this requester marked ineligible.

    ``squatting=True`` also marks devices whose lock file is unusable (a choice made without
    leasing must never offer what a lease would refuse; a lease finds out by itself).
    """
    held = blocked(look.directory, look.devices, look.leases, ticket, count, policy=look.policy)
    out = [c.refused(held[c.gpu.uuid]) if c.eligible and c.gpu.uuid in held else c
           for c in candidates]
    if squatting:
        squatted = blocked_devices(look.directory, [c.gpu.uuid for c in out if c.eligible])
        out = [c.refused(squatted[c.gpu.uuid]) if c.gpu.uuid in squatted else c for c in out]
    return out
