"""LeakDetector: watch a hand-written training loop for memory that keeps growing.

At each ``ld.step()`` it finds the holders the loop can keep (the calling frame's locals and
globals, the closure cells and globals of the step functions among them, and the globals the
methods of the loop's objects name, named as ``dk.find_leaks`` names them; two named steps deep,
and the closure cells of functions kept there: ``total_loss``, ``model.history``, ``cache``,
``self.last_error``, ``self.track.running``), measures each one (the storage it keeps alive, items, autograd
nodes; :mod:`~devicekit.memory.leaks.measure`), and, with ``cycles=True``, collects the cyclic
garbage of the step to see tensors held by reference cycles. A holder leaks when it keeps
growing after ``warmup`` steps (see :mod:`~devicekit.memory.leaks.trend` and
:mod:`~devicekit.memory.leaks.judge`). With ``lines=True`` a holder that grew and has no line
yet is followed line by line during the next step, three steps at most
(:mod:`~devicekit.memory.leaks.lines`), which names the line that extended it.

What a step costs stays flat while a leak grows: a list of tensors is measured by what was
appended since the last step, autograd graphs walked at the last step are merged rather than
walked again (:mod:`~devicekit.memory.leaks.holder_sizes`), the named walk runs on the first
steps and then every few, and the tracer stops once it has answered.

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
alive two steps later are traced back to the nearest named thing (a module's hook dict,
``opt.param_groups``, a class attribute, an ``lru_cache``, an exception chain, suspended
generators; :mod:`~devicekit.memory.leaks.discovery`). Tensors that survive every step with no
name found are a leak too (holder ``(no holder found)``, ``report.ok`` False), reported with what
the search went through. An object that gains an attribute under a new name every step
(``setattr(model, f"act_{step}", h)``, ``model.add_module(f"probe_{step}", ...)``) keeps every one
though no container of the user's grows: its attribute dict (``model.__dict__``, a module's
``model._modules``; named up front or found from the memory) is measured by the names it gained
since it was first seen, a new submodule by its parameters and buffers.

From a framework callback, which does not own the loop: ``ld.start()`` when training starts,
``ld.step()`` after each training step, ``ld.report()`` then ``ld.stop()`` at the end (and on an
exception); ``watch=`` names the model and optimizer the callback's frame does not show.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from devicekit.errors import InvalidValueError
from devicekit.memory.leaks.cycles import CycleSample, CycleWatch
from devicekit.memory.leaks.discovery import (
    HolderDiscovery,
    closure_roots,
    code_roots,
    method_roots,
)
from devicekit.memory.leaks.holder_sizes import HolderSizes
from devicekit.memory.leaks.holders import Holder, discover, namespaces
from devicekit.memory.leaks.judge import (
    HolderFacts,
    cycle_leak,
    holder_leak,
    most_specific,
    unnamed_leak,
)
from devicekit.memory.leaks.lines import LineTracer
from devicekit.memory.leaks.measure import Size
from devicekit.memory.leaks.new_names import NewNames
from devicekit.memory.leaks.report import LeakReport, coverage_notes
from devicekit.memory.leaks.trend import growth
from devicekit.memory.roots import MISSING, Root, frame_roots
from devicekit.units import format_size

__all__ = ["LeakDetector"]

_DISCOVER_EVERY = 4  # steps between walks for named holders (after the first two)
_TRACE_STEPS = 3  # steps the line tracer follows one holder that grew, at most


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
        self._watch_names = tuple(watch or ())
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
        self._sizes = HolderSizes()  # what each holder keeps, measured cheaply step after step
        self._trace_count: dict[str, int] = {}  # steps traced for a holder's line
        self._found: dict[str, Holder] | None = None  # the named holders, as last discovered
        self._frame: list[types.FrameType | None] = [None]  # the latest step()'s frame
        self._bound: dict[str, Holder] = {}  # holders found from the memory, reading _frame
        self._discovery = HolderDiscovery()
        self._code_roots_of: Callable[[types.FrameType | None], list[Root]] = self._frame_code_roots
        # attribute dicts (`model.__dict__`, `model._modules`), as last discovered; the names each
        # had when first seen; those measured (it gained a name that keeps memory); what it gained
        self._names = NewNames()
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
        self._sizes.clear()
        self._found = None
        self._frame[0] = None
        self._bound.clear()
        self._names.clear()
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
        if frame is not None:  # a step function's closure cells, named as find_leaks names them
            taken = {root.name for root in roots} | set(self._watch_names)
            roots += closure_roots(frame.f_locals, taken)
            # and the globals the methods of the loop's objects name (a LightningModule's `self`)
            roots += method_roots([*frame.f_locals.values(), *(root.get() for root in self._extra)], taken)
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
        if self._cycle_watch is not None:  # the tensors this step made, before its collection
            self._discovery.survivors.note(step)
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
        if self._found is None or step <= 2 or step % _DISCOVER_EVERY == 0:
            # the named walk costs more than measuring: every few steps (a holder made in between
            # is found from the memory), kept without the frame it was read from
            found = discover(roots)
            self._found = found if frame is None else {path: self._in_frame(h) for path, h in found.items()}
            spaces = namespaces(roots)
            self._names.spaces = spaces if frame is None else {path: self._in_frame(h) for path, h in spaces.items()}
        if frame is not None:
            self._frame[0] = frame  # what holders under a local name read (see _in_frame)
        # the names each attribute dict has now are its own (read after the frame is set: an
        # older frame's locals stay as they are)
        self._names.note_first_seen()
        holders = dict(self._found)
        for path, holder in self._names.gaining().items():
            holders.setdefault(path, holder)
        for path, holder in self._discovery.holders.items():
            if path not in holders:
                if frame is not None and path not in self._bound:
                    self._bound[path] = self._in_frame(holder)
                holders[path] = self._bound.get(path, holder)
        grew: dict[str, Holder] = {}
        seen: set[int] = set()
        held: set[int] = set()
        self._record(holders, step, hits, grew, seen, held)
        unexplained = [t for t in survivors if id(t) not in seen]
        del survivors
        if unexplained:
            new = self._discovery.search(unexplained, roots + self._code_roots_of(frame), step, held,
                                         fixed_roots=frame is None)
            self._names.note_first_seen(new)  # an attribute dict found from the memory
            self._record(new, step, hits, grew, seen, held)
            self._refresh(holders, self._discovery.through_held, step, hits, grew, seen)
        del unexplained
        self._sizes.graphs.sweep()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self._allocated.append((step, torch.cuda.memory_allocated()))
        # lines are traced only for what grew and has no line yet, a few steps at most each: the
        # tracer costs a leaking step most of what the check costs, so it stops once it has answered
        if step < self.warmup:  # what grows in warm-up (Adam's state) needs no line: the next step is warm-up too
            grew, cycle_types = {}, ()
        grew = {path: h for path, h in grew.items() if path not in self._line_of and self._traced(path)}
        cycle_types = tuple(t for t in cycle_types if f"type:{t.__name__}" not in self._line_of
                            and self._traced(f"type:{t.__name__}"))
        self._tracer.watch(grew)  # also when empty: the last step's holders may read an old frame
        self._tracer.watch_types(cycle_types)
        if self.lines and (grew or cycle_types):
            self._tracer.start(frame)
            if self._tracer.blocked and self._tracer.blocked not in self._notes:
                self._notes.append(self._tracer.blocked)

    def _refresh(self, holders: dict[str, Holder], ids: set[int], step: int, hits: dict[str, tuple[str, int]],
                 grew: dict[str, Holder], seen: set[int]) -> None:
        """Measure afresh the holders a survivor was found in whose size came from a cache."""
        stale = {path: holder for path, holder in holders.items()
                 if self._sizes.cached(path) and id(holder.get()) in ids}
        for path in stale:
            self._sizes.forget(path)
            series = self._series[path]
            if series and series[-1][0] == step:
                series.pop()
        if stale:
            self._record(stale, step, hits, grew, seen, set())

    def _traced(self, key: str) -> bool:
        """Count one more traced step for ``key``; False once it had :data:`_TRACE_STEPS`."""
        count = self._trace_count.get(key, 0)
        self._trace_count[key] = count + 1
        return count < _TRACE_STEPS

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
        """Measure; an attribute dict by the names it gained since it was first seen (its own
        attributes, a module's parameters, are not what a name added every step keeps)."""
        view = self._names.view(path, value)
        if view is None:
            return self._sizes.measure(path, value, seen)
        try:
            return self._sizes.measure(path, view, seen)
        finally:
            view.clear()  # the view keeps nothing alive between steps

    # -- verdict ---------------------------------------------------------------------------
    def report(self) -> LeakReport:
        """The leaks found so far. The line tracer pauses (the next step resumes it), so a
        detector used without ``with`` leaves no trace function behind once reported."""
        if self._tracer.active:
            self._tracer.check()
            self._tracer.stop()
        leaks = []
        for path, series in self._series.items():
            via, is_lru = self._discovery.pattern(path)
            post = [size for step, size in series if step >= self.warmup]
            leak = holder_leak(path, post, self._info[path], self._line_of.get(path, ("", 0)), via=via, is_lru=is_lru)
            if leak is not None and self._names.added(path):  # the names it gained: `act_1, act_2, ...`
                leak = dataclasses.replace(leak, detail=f"{leak.detail}: {', '.join(self._names.added(path))}, ...")
            if leak is not None:
                leaks.append(leak)
        leaks = most_specific(leaks, self._sizes.inside)
        cycle = cycle_leak([sample for step, sample in self._cycles if step > self.warmup], self._cycle_line())
        if cycle is not None:
            leaks.append(cycle)
        notes = list(self._notes)
        if self._discovery.survivors.disabled:
            notes.append(self._discovery.survivors.disabled)
        series, what = self._discovery.unnamed_series(self.warmup, self._step)
        unnamed = unnamed_leak(series, what, self._discovery.roots_searched)
        if unnamed is not None:
            leaks.append(unnamed)
            notes.append(f"tensors created every step survive with no holder found "
                         f"(+{format_size(unnamed.bytes_per_step)}/step, {what}): look at dk.memory.census() "
                         f"between steps")
        leaks.sort(key=lambda leak: -leak.bytes_per_step)
        minor = [leak for leak in leaks if leak.severity == "minor"]
        leaks = [leak for leak in leaks if leak.severity != "minor"]
        rate = growth([n for step, n in self._allocated if step >= self.warmup])
        notes += coverage_notes(leaks, self._step, self.warmup, lines=self.lines, cycles=self.cycles,
                                allocated_rate=rate)
        return LeakReport(leaks, self._step, self.warmup, len(self._series), self.lines, notes, minor)


    def _in_frame(self, holder: Holder) -> Holder:
        """A holder under a local name reads the frame of the latest ``step()`` (a callback's
        ``step()`` runs in a new frame each time: only the latest is kept, by the detector)."""
        if holder.origin != "local":
            return holder
        root = Root(holder.root.name, "local", functools.partial(_read_local, self._frame, holder.root.name))
        return dataclasses.replace(holder, root=root)

    def _cycle_line(self) -> tuple[str, int]:
        """The line that made the most common cycle holder's objects, if traced."""
        held = [s for step, s in self._cycles if step > self.warmup and s.bytes > 0 and s.holder]
        if not held:
            return ("", 0)
        holder = max({s.holder for s in held}, key=lambda h: sum(s.holder == h for s in held))
        holder_type = next((s.holder_type for s in held if s.holder == holder), None)
        return self._line_of.get(f"type:{holder_type.__name__}" if holder_type else "", ("", 0))


def _read_local(current: list[types.FrameType | None], name: str) -> Any:
    frame = current[0]
    return MISSING if frame is None else frame.f_locals.get(name, MISSING)
