"""LeakDetector: watch a hand-written training loop for memory that keeps growing.

At each ``ld.step()`` it finds the holders the loop can keep (the calling frame's locals and
globals, two named steps deep: ``total_loss``, ``model.history``, ``cache``), measures each one
(tensor bytes, items, autograd nodes), and, with ``cycles=True``, collects the cyclic garbage of
the step to see tensors held by reference cycles. A holder leaks when it keeps growing after
``warmup`` steps (see :mod:`~devicekit.memory.leaks.trend`). With ``lines=True`` the holders
that grew on the last step are followed line by line during the next one
(:mod:`~devicekit.memory.leaks.lines`), which names the line that extended them.

Usage::

    import devicekit as dk

    total_loss = 0
    with dk.LeakDetector(warmup=2) as ld:
        for x, y in batches:
            loss = loss_fn(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()
            total_loss += loss            # the leak: keeps every graph
            ld.step()
    print(ld.report())                    # total_loss: autograd graph kept alive, line 7, fix: .item()

Holders no name reaches are found from the memory: the tensors a step created that are still
alive after the next step are traced back to the nearest named thing (a module's hook dict,
``opt.param_groups``, a class attribute, an ``lru_cache``; :mod:`~devicekit.memory.leaks.discovery`).

From a framework callback, which does not own the loop: ``ld.start()`` when training starts,
``ld.step()`` after each training step, ``ld.report()`` then ``ld.stop()`` at the end (and on an
exception); ``watch=`` names the model and optimizer the callback's frame does not show.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from devicekit.errors import InvalidValueError
from devicekit.memory.leaks.cycles import CycleSample, CycleWatch
from devicekit.memory.leaks.discovery import HolderDiscovery, code_roots
from devicekit.memory.leaks.holders import Holder, discover
from devicekit.memory.leaks.lines import LineTracer, fingerprint
from devicekit.memory.leaks.measure import Size, measure
from devicekit.memory.leaks.report import Leak, LeakReport
from devicekit.memory.leaks.trend import growth, slope
from devicekit.memory.leaks.verdict import detail_of, fix_for, kind_of, pattern_of, via_of
from devicekit.memory.paths import CONTAINERS
from devicekit.memory.roots import MISSING, Root, frame_roots
from devicekit.units import format_size

__all__ = ["LeakDetector"]

_REMEASURE_BELOW = 256
_SCALAR_BYTES = 16  # bytes per one-element tensor at most for "a log of scalars" (complex128)


class HolderFacts(NamedTuple):
    """What the verdict needs to know of a holder, kept without the object itself."""

    #: the kind of root the holder was reached from (a local of the step, a global, a watched object)
    origin: str
    #: reached through an ``nn.Module``'s attributes
    in_module: bool
    #: the holder is itself a tensor (not a container of them)
    is_tensor: bool


class LeakDetector:
    """Find leaks in a loop you write; see the module docstring.

    ``watch``: extra objects to follow by name (``watch={"trainer": trainer}``), for holders the
    calling frame cannot see. ``lines``: attribute leaks to source lines (costs more only while
    something grows). ``cycles``: look for tensors held by reference cycles, and for the tensors
    each step leaves alive that no name reaches (both need automatic garbage collection paused
    and older objects frozen while watching, restored on exit; with ``cycles=False`` only named
    holders are followed).
    """

    def __init__(self, *, warmup: int = 2, lines: bool = True, cycles: bool = True,
                 watch: dict[str, Any] | None = None) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise InvalidValueError(f"warmup={warmup!r} must be a whole number of steps >= 0")
        if watch is not None and not isinstance(watch, dict):
            raise InvalidValueError(
                f"watch={watch!r} is not a dict; pass names and objects, e.g. watch={{'trainer': trainer}}"
            )
        self.warmup = warmup
        self.lines = lines
        self.cycles = cycles
        self._extra = [Root(name, "watch", (lambda v=value: v)) for name, value in (watch or {}).items()]
        self._roots_of: Callable[[types.FrameType | None], list[Root]] = self._frame_roots
        self._series: dict[str, list[tuple[int, Size]]] = {}
        # path -> what the verdict needs of a holder, without the object itself
        self._info: dict[str, HolderFacts] = {}
        self._cycles: list[tuple[int, CycleSample]] = []
        self._line_of: dict[str, tuple[str, int]] = {}
        self._tracer = LineTracer()
        self._cycle_watch = CycleWatch() if cycles else None
        self._notes: list[str] = []
        self._allocated: list[tuple[int, int]] = []
        self._big: dict[str, tuple[Any, Size, frozenset[int]]] = {}
        self._discovery = HolderDiscovery()
        # path -> (id of its value, ids of the containers inside it), as last measured
        self._inside: dict[str, tuple[int, set[int]]] = {}
        self._code_roots_of: Callable[[types.FrameType | None], list[Root]] = self._frame_code_roots
        self._step = 0
        self._started = False
        self._stopped = False

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> LeakDetector:
        self.start(sys._getframe(1))
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, frame: types.FrameType | None = None) -> None:
        """Take the baseline (step 0); ``frame``: the loop's frame (default: the caller's)."""
        if self._started:
            return
        self._started = True
        if self._cycle_watch is not None:
            self._cycle_watch.start()
        self._sample(frame if frame is not None else sys._getframe(1), baseline=True)

    def stop(self) -> None:
        """Stop tracing and restore garbage collection; the measurements stay for :meth:`report`."""
        self._tracer.stop()
        self._tracer.watch({})
        if self._cycle_watch is not None:
            self._cycle_watch.stop()
        self._roots_of = lambda _frame: []  # drop the frames and objects: the detector may outlive them
        self._code_roots_of = lambda _frame: []
        self._extra = []
        self._discovery.clear()
        self._big.clear()
        self._stopped = True

    def step(self) -> None:
        """Mark the end of one step (call it once per iteration, at the same place)."""
        frame = sys._getframe(1)
        if self._stopped:
            raise InvalidValueError("LeakDetector.step() called after stop(); use a new LeakDetector")
        if not self._started:  # no `with`: nothing guarantees stop(), so gc is never paused
            self._cycle_watch = None
            self._notes.append("reference cycles not checked, and only named holders followed (not the "
                               "memory): use `with LeakDetector() as ld:` or ld.start()/ld.stop() for that")
            self.start(frame)
            return
        self._sample(frame)

    # -- measurement -----------------------------------------------------------------------
    def _frame_roots(self, frame: types.FrameType | None) -> list[Root]:
        roots = frame_roots(frame) if frame is not None else []
        return roots + self._extra

    @staticmethod
    def _frame_code_roots(frame: types.FrameType | None) -> list[Root]:
        if frame is None:
            return []
        roots = code_roots(frame.f_locals)
        return roots if frame.f_locals is frame.f_globals else roots + code_roots(frame.f_globals)

    def _sample(self, frame: types.FrameType | None, *, baseline: bool = False) -> None:
        if frame is not None:
            # refresh the frame's locals snapshot (Python < 3.13) before looking for survivors:
            # the one taken at the last step still holds that step's values
            frame.f_locals  # noqa: B018
        if self._tracer.active:
            self._tracer.check()
            self._tracer.stop()
        hits = dict(self._tracer.hits)
        self._tracer.hits.clear()
        if not baseline:
            self._step += 1
        step = self._step
        cycle_types: tuple[type, ...] = ()
        if self._cycle_watch is not None and not baseline:
            found = self._cycle_watch.sample()  # also this step's garbage collection
            self._cycles.append((step, found))
            if found.holder_type is not None:
                key = f"type:{found.holder_type.__name__}"
                if key in hits:
                    self._line_of[key] = hits[key]
                cycle_types = (found.holder_type,)
        survivors = self._discovery.scan(step) if self._cycle_watch is not None else []
        roots = self._roots_of(frame)
        holders = discover(roots)
        for path, holder in self._discovery.holders.items():
            if path not in holders:
                holders[path] = _in_frame(holder, frame)
        grew: dict[str, Holder] = {}
        seen: set[int] = set()
        held: set[int] = set()
        self._record(holders, step, hits, grew, seen, held)
        unexplained = [t for t in survivors if id(t) not in seen]
        del survivors
        if unexplained:
            new = self._discovery.search(unexplained, roots + self._code_roots_of(frame), step, held)
            self._record(new, step, hits, grew, seen, held)
        del unexplained
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._allocated.append((step, torch.cuda.memory_allocated()))
        if self.lines and (grew or cycle_types):
            self._tracer.watch(grew)
            self._tracer.watch_types(cycle_types)
            self._tracer.start(frame)
            if self._tracer.blocked and self._tracer.blocked not in self._notes:
                self._notes.append(self._tracer.blocked)

    def _record(self, holders: dict[str, Holder], step: int, hits: dict[str, tuple[str, int]],
                grew: dict[str, Holder], seen: set[int], held: set[int]) -> None:
        """Measure each holder now; note those that grew since the last step."""
        for path, holder in holders.items():
            value = holder.get()
            held.add(id(value))
            size = self._measure(path, value, seen)
            self._info[path] = HolderFacts(holder.origin, holder.in_module,
                                           isinstance(value, torch.Tensor))
            del value
            series = self._series.setdefault(path, [])
            if series and series[-1][0] == step - 1 and size.effective > series[-1][1].effective:
                grew[path] = holder
                if path in hits:
                    self._line_of[path] = hits[path]
            series.append((step, size))

    def _measure(self, path: str, value: Any, seen: set[int]) -> Size:
        """Measure; a big container whose identity and length did not change keeps its last size
        (walking a 10,000-item dataset list every step would cost more than the step)."""
        if not isinstance(value, CONTAINERS) or len(value) < _REMEASURE_BELOW:
            inside: set[int] = set()
            size = measure(value, seen=seen, inside=inside)
            inside.discard(id(value))
            self._inside[path] = (id(value), inside)
            return size
        print_ = fingerprint(value)
        last = self._big.get(path)
        if last is not None and last[0] == print_:
            seen.update(last[2])
            return last[1]
        ids: set[int] = set()
        size = measure(value, seen=ids)
        seen.update(ids)
        self._big[path] = (print_, size, frozenset(ids))
        return size

    # -- verdict ---------------------------------------------------------------------------
    def report(self) -> LeakReport:
        """The leaks found so far. The line tracer pauses (the next step resumes it), so a
        detector used without ``with`` leaves no trace function behind once reported."""
        if self._tracer.active:
            self._tracer.check()
            self._tracer.stop()
        leaks = [leak for path in self._series if (leak := self._holder_leak(path)) is not None]
        leaks = _most_specific(leaks, self._inside)
        cycle = self._cycle_leak()
        if cycle is not None:
            leaks.append(cycle)
        leaks.sort(key=lambda leak: -leak.bytes_per_step)
        minor = [leak for leak in leaks if leak.severity == "minor"]
        leaks = [leak for leak in leaks if leak.severity != "minor"]
        notes = list(self._notes)
        if self._discovery.survivors.disabled:
            notes.append(self._discovery.survivors.disabled)
        unnamed = growth(_cumulative(self._discovery.unnamed_bytes, self.warmup, self._step))
        if unnamed is not None:
            notes.append(f"tensors created every step survive with no holder found "
                         f"(+{format_size(unnamed)}/step): look at dk.memory.census() between steps")
        if self._step - self.warmup < 2:
            notes.append(f"only {self._step} step(s) measured with warmup={self.warmup}: "
                         f"a leak needs at least 2 steps after warm-up to show")
        if any(leak.lineno == 0 for leak in leaks) and self.lines:
            notes.append("some lines are unknown: the holder grew inside library code or only once traced")
        if not self.lines:
            notes.append("line attribution off (lines=False)")
        if not self.cycles:
            notes.append("cycles=False: reference cycles and memory no name reaches not checked")
        post = [n for step, n in self._allocated if step >= self.warmup]
        rate = growth(post)
        explained = sum(leak.bytes_per_step for leak in leaks)
        if rate is not None and explained < 0.5 * rate:
            notes.append(f"CUDA memory allocated grows by {format_size(rate)}/step but the holders "
                         f"found explain {format_size(explained)}/step: look at dk.memory.census() "
                         f"between steps")
        return LeakReport(leaks, self._step, self.warmup, len(self._series), self.lines, notes, minor)

    def _holder_leak(self, path: str) -> Leak | None:
        post = [size for step, size in self._series[path] if step >= self.warmup]
        rate = growth([s.effective for s in post])
        if rate is None:
            return None
        facts = self._info[path]
        nodes_rate = slope([s.nodes for s in post])
        via, is_lru = self._discovery.pattern(path)
        via = via or via_of(post[-1].through)
        kind = pattern_of(path, via=via, origin=facts.origin, is_lru=is_lru) or kind_of(
            in_module=facts.in_module, is_tensor=facts.is_tensor, nodes_grow=nodes_rate > 0)
        last = post[-1]
        filename, lineno = self._line_of.get(path, ("", 0))
        items_rate = slope([s.items for s in post])
        # a log of detached scalars (`losses.append(loss.detach().cpu())`): a few bytes per item
        scalars_rate = slope([s.scalars for s in post])
        minor = (nodes_rate <= 0 and not last.graph_alive and scalars_rate >= 1
                 and scalars_rate >= slope([s.tensors for s in post]) and rate / scalars_rate <= _SCALAR_BYTES)
        where = f"{os.path.basename(filename)}:{lineno}" if lineno else ""
        fix = fix_for(kind, path, graph_alive=last.graph_alive, has_graph=last.nodes > 0)
        if minor:
            fix = (f"`{path}` grows by one scalar a step: fine for a log; keep Python numbers "
                   f"(`.item()`) or bound it if the run is very long")
        return Leak(
            holder=path, kind=kind, filename=filename, lineno=lineno, bytes_per_step=round(rate),
            fix=fix, origin=facts.origin, total_bytes=last.effective,
            items_per_step=round(items_rate, 2), nodes_per_step=round(nodes_rate, 2),
            estimated=last.nodes > 0 or last.estimated, series=[s.effective for s in post],
            detail=detail_of(kind, via=via, where=where), severity="minor" if minor else "leak",
        )

    def _cycle_leak(self) -> Leak | None:
        post = [sample for step, sample in self._cycles if step > self.warmup]
        with_tensors = [s for s in post if s.bytes > 0]
        if len(post) < 2 or not post[-1].bytes or len(with_tensors) < max(2, 0.75 * len(post)):
            return None
        holder = max({s.holder for s in with_tensors if s.holder},
                     key=lambda h: sum(s.holder == h for s in with_tensors))
        holder_type = next((s.holder_type for s in with_tensors if s.holder == holder), None)
        where = self._line_of.get(f"type:{holder_type.__name__}" if holder_type else "", ("", 0))
        rate = round(sum(s.bytes for s in with_tensors) / len(post))
        return Leak(holder=holder, kind="reference_cycle", filename=where[0], lineno=where[1],
                    bytes_per_step=rate, fix=fix_for("reference_cycle", holder, graph_alive=False,
                                                     has_graph=False),
                    origin="cycle", total_bytes=sum(s.bytes for s in with_tensors),
                    series=[s.bytes for s in post])


def _in_frame(holder: Holder, frame: types.FrameType | None) -> Holder:
    """A holder found under a local name is read from the current frame (a callback's
    ``step()`` runs in a new frame each time; the old one must not be kept alive)."""
    if holder.origin != "local" or frame is None:
        return holder
    name = holder.root.name
    root = Root(name, "local", lambda: frame.f_locals.get(name, MISSING))
    return dataclasses.replace(holder, root=root)


def _cumulative(points: list[tuple[int, int]], warmup: int, last: int) -> list[int]:
    """Running total of unnamed survivor bytes per step after warm-up (0 on steps with none)."""
    per_step = dict(points)
    total, series = 0, []
    for step in range(max(warmup, 2), last + 1):
        total += per_step.get(step, 0)
        series.append(total)
    return series


def _most_specific(leaks: list[Leak], inside: dict[str, tuple[int, set[int]]]) -> list[Leak]:
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
