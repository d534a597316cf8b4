"""The order: eligible candidates ranked as asked, the best ``count`` chosen, a line for the rest.

Usage::

    from devicekit.selection.ranking import choose, rejected

    chosen = choose(candidates, request)          # [] when too few are eligible
    ranked = rank(candidates, request)            # every eligible one, best first
    print(rejected(candidates, chosen, request))  # ['GPU 0: eligible but not needed (...)', ...]
"""

from __future__ import annotations

from collections.abc import Sequence

from devicekit.selection.candidates import Candidate
from devicekit.selection.gpu_request import Request

__all__ = ["ordered", "rank", "choose", "rejected"]


def ordered(eligible: Sequence[Candidate], order: str) -> list[Candidate]:
    """``eligible`` in the request's order (best first)."""
    if order == "free-memory":
        return sorted(eligible, key=lambda c: (-c.available, c.gpu.index))
    if order == "utilization":
        return sorted(eligible, key=lambda c: (c.gpu.utilization or 0.0, -c.available, c.gpu.index))
    if order == "fastest":  # strongest first (capability score), then most free memory
        from devicekit.hardware.capability import capabilities

        scores = {c.gpu.uuid: s.score for c, s in zip(eligible, capabilities([c.gpu for c in eligible]),
                                                      strict=True)}
        return sorted(eligible, key=lambda c: (-scores[c.gpu.uuid], -c.available, c.gpu.index))
    if order == "random":
        import random  # imported here: it costs the CLI's cold start a few ms

        shuffled = list(eligible)
        random.shuffle(shuffled)
        return shuffled
    return sorted(eligible, key=lambda c: c.gpu.index)


def rank(candidates: Sequence[Candidate], request: Request) -> list[Candidate]:
    """Every eligible candidate, best first."""
    return ordered([c for c in candidates if c.eligible], request.order)


def choose(candidates: Sequence[Candidate], request: Request) -> list[Candidate]:
    """The best ``request.count`` eligible candidates (all for None), or [] when too few."""
    eligible = ordered([c for c in candidates if c.eligible], request.order)
    if request.count is None:
        return eligible
    return eligible[: request.count] if len(eligible) >= request.count else []


def rejected(candidates: Sequence[Candidate], chosen: Sequence[Candidate],
             request: Request) -> list[str]:
    """One line for every candidate not chosen, saying why."""
    picked = {c.gpu.uuid for c in chosen}
    lines = []
    for c in candidates:
        if c.gpu.uuid in picked:
            continue
        if c.eligible:
            lines.append(f"{c.gpu.label}: eligible but not needed "
                         f"({request.count} asked, order {request.order})")
        else:
            lines.append(c.line())
    return lines
