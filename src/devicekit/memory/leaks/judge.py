"""From measured series to leaks: rate, kind, severity, line, fix and projection of each holder.

:func:`holder_leak` judges one holder's series of :class:`~devicekit.memory.leaks.measure.Size`
after warm-up: is it growing (:mod:`~devicekit.memory.leaks.trend`), by how much, of what kind
(:mod:`~devicekit.memory.leaks.verdict`), and what the code around the line that grew it does
(:mod:`~devicekit.memory.leaks.hints`). Slow growth that is not a leak goes to ``minor``: a log of
detached scalars; 0-d values whose storage is the larger buffer they were reduced from (torch's
CPU ``mse_loss(...).detach()`` keeps the elementwise buffer), up to :data:`BUFFER_MINOR` bytes
each; and a holder without graphs that the code empties periodically (bounded by the period),
up to :data:`CLEARED_MINOR` bytes a step. A leak that is emptied periodically stays a leak, but
its projection stops where the code empties it.
:func:`cycle_leak` judges the reference-cycle samples, :func:`unnamed_leak` the tensors that
survive every step with no holder found (a leak too: ``report.ok`` is then False), and
:func:`most_specific` drops a holder that one measured inside it explains.

Usage::

    leak = holder_leak("total_loss", post, facts, ("train.py", 11), via="", is_lru=False)
    leak.kind, leak.fix, leak.projection
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

from devicekit.memory.leaks.cycles import CycleSample
from devicekit.memory.leaks.hints import hints
from devicekit.memory.leaks.measure import THROUGH, Size
from devicekit.memory.leaks.report import Leak
from devicekit.memory.leaks.trend import growth, slope
from devicekit.memory.leaks.verdict import detail_of, fix_for, kind_of, pattern_of, via_of
from devicekit.units import format_size

__all__ = ["BUFFER_MINOR", "CLEARED_MINOR", "HolderFacts", "cycle_leak", "holder_leak", "most_specific", "unnamed_leak"]

_SCALAR_BYTES = 16  # bytes per one-element tensor at most for "a log of scalars" (complex128)
#: bytes a 0-d value may keep (the buffer it was reduced from) and still be slow growth
BUFFER_MINOR = 1024
#: bytes per step a holder the code empties periodically may gain and still be slow growth
CLEARED_MINOR = 16 * 1024


class HolderFacts(NamedTuple):
    """What the verdict needs to know of a holder, kept without the object itself."""

    #: the kind of root the holder was reached from (a local of the step, a global, a watched object)
    origin: str
    #: reached through an ``nn.Module``'s attributes
    in_module: bool
    #: the holder is itself a tensor (not a container of them)
    is_tensor: bool


def holder_leak(path: str, post: Sequence[Size], facts: HolderFacts, line: tuple[str, int], *,
                via: str, is_lru: bool) -> Leak | None:
    """The leak of ``path`` from its sizes after warm-up (``post``), or None when it does not grow."""
    rate = growth([s.effective for s in post])
    if rate is None:
        return None
    last = post[-1]
    nodes_rate = slope([s.nodes for s in post])
    through = last.through
    if slope([s.attr_bytes for s in post]) < 0.5 * rate:  # tensors' attributes are not what grows
        through &= ~THROUGH["tensor_attr"]
    via = via + via_of(through)  # the path found from the memory, and what the measurement went through
    kind = pattern_of(path, via=via, origin=facts.origin, is_lru=is_lru) or kind_of(
        in_module=facts.in_module, is_tensor=facts.is_tensor, nodes_grow=nodes_rate > 0)
    filename, lineno = line
    found = hints(filename, lineno, path)
    items_rate = slope([s.items for s in post])
    # a log of detached scalars (`losses.append(loss.detach().cpu())`): a few bytes per item,
    # or the buffer each 0-d value was reduced from (`mse_loss(...).detach()` on the CPU)
    scalars_rate = slope([s.scalars for s in post])
    no_graph = nodes_rate <= 0 and not last.graph_alive
    scalar_log = no_graph and scalars_rate >= 1 and scalars_rate >= slope([s.tensors for s in post])
    per_scalar = rate / scalars_rate if scalar_log else 0.0
    buffers = scalar_log and per_scalar > _SCALAR_BYTES and slope([s.scalar_bytes for s in post]) >= 0.8 * rate
    minor = scalar_log and (per_scalar <= _SCALAR_BYTES or (buffers and per_scalar <= BUFFER_MINOR))
    cleared = ""
    if found.cleared_at is not None:
        cleared_file, cleared_line, cleared_in = found.cleared_at
        cleared = f"{os.path.basename(cleared_file)}:{cleared_line} ({cleared_in})"
        # bounded by how often it is emptied: slow growth, unless a step adds much (an epoch is long)
        minor = minor or (no_graph and rate <= CLEARED_MINOR)
    where = f"{os.path.basename(filename)}:{lineno}" if lineno else ""
    fix = fix_for(kind, path, graph_alive=last.graph_alive, has_graph=last.nodes > 0,
                  graph_freed=last.graph_freed, flags=found.flags, through=last.through, line=found.line)
    detail = detail_of(kind, via=via, where=where, flags=found.flags)
    if buffers:
        each = format_size(round(per_scalar))
        detail = f"0-d values that keep a {each} buffer each"
        fix = (f"each 0-d value in `{path}` keeps the whole buffer it was reduced from ({each} instead of "
               f"one number): store `loss.detach().clone()` (its own 1-element storage) or `loss.item()`")
    elif minor and scalar_log:
        fix = (f"`{path}` grows by one scalar a step: fine for a log; keep Python numbers "
               f"(`.item()`) or bound it if the run is very long")
    elif minor:
        fix = (f"`{path}` is emptied at {cleared}, so it grows only until then: fine if that period is "
               f"short; store `.item()` or `.detach().cpu()` values to keep it small")
    elif cleared and no_graph:
        fix = (f"`{path}` gains {format_size(round(rate))} a step until it is emptied at {cleared}: keep "
               f"less per step (`.item()`, a reduced value, `.cpu()` for GPU tensors) or empty it more often")
    return Leak(
        holder=path, kind=kind, filename=filename, lineno=lineno, bytes_per_step=round(rate),
        fix=fix, origin=facts.origin, total_bytes=last.effective,
        items_per_step=round(items_rate, 2), nodes_per_step=round(nodes_rate, 2),
        estimated=last.nodes > 0 or last.estimated, series=[s.effective for s in post],
        detail=detail, severity="minor" if minor else "leak", cleared_at=cleared,
    )


def cycle_leak(samples: Sequence[CycleSample], line: tuple[str, int]) -> Leak | None:
    """The reference-cycle leak from the samples after warm-up, if cycles hold tensors every step."""
    with_tensors = [s for s in samples if s.bytes > 0]
    if len(samples) < 2 or not samples[-1].bytes or len(with_tensors) < max(2, 0.75 * len(samples)):
        return None
    holder = max({s.holder for s in with_tensors if s.holder},
                 key=lambda h: sum(s.holder == h for s in with_tensors))
    rate = round(sum(s.bytes for s in with_tensors) / len(samples))
    return Leak(holder=holder, kind="reference_cycle", filename=line[0], lineno=line[1],
                bytes_per_step=rate, fix=fix_for("reference_cycle", holder, graph_alive=False, has_graph=False),
                origin="cycle", total_bytes=sum(s.bytes for s in with_tensors),
                series=[s.bytes for s in samples])


def unnamed_leak(series: Sequence[int], what: str, roots: int) -> Leak | None:
    """Tensors made every step that stay alive with no holder found: reported, with what was tried."""
    rate = growth(series)
    if rate is None:
        return None
    fix = (f"searched from {roots} named roots (the loop's variables, the step's closure and globals, "
           f"`watch=`) through attributes, containers, closures and defaults, module hooks and buffers, "
           f"optimizer state, lru_cache results, exceptions and their frames, generator frames, tensor "
           f"attributes and numpy arrays, and found no name that keeps them: pass the object that keeps "
           f"them as `watch={{'name': obj}}`, or look with `gc.get_referrers(t)` / `dk.memory.census()` "
           f"between steps")
    return Leak(holder="(no holder found)", kind="unnamed", filename="", lineno=0, bytes_per_step=round(rate),
                fix=fix, origin="memory", total_bytes=series[-1] if series else 0, series=list(series),
                detail=what)


def most_specific(leaks: list[Leak], inside: dict[str, tuple[int, set[int]]]) -> list[Leak]:
    """Drop ``stats`` when ``stats['losses']`` (or another holder measured inside it) explains its
    growth; but a holder that gains entries every step (a hook dict, ``param_groups``) is the
    cause, not what one of its entries holds."""
    def contains(outer: Leak, inner: Leak) -> bool:
        if inner.holder.startswith(outer.holder) and inner.holder[len(outer.holder):][:1] in (".", "["):
            return True
        outer_id, ids = inside.get(outer.holder, (0, set()))
        inner_id = inside.get(inner.holder, (-1, set()))[0]
        return inner_id in ids and inner_id != outer_id

    kept = []
    for leak in leaks:
        if any(o is not leak and o.items_per_step >= 1 and contains(o, leak) for o in leaks):
            continue
        inner = [o for o in leaks if o is not leak and contains(leak, o)]
        if leak.items_per_step >= 1 or not any(o.bytes_per_step * 2 >= leak.bytes_per_step for o in inner):
            kept.append(leak)
    return kept
