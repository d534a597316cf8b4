"""The second step's peak, read from the first: one fake step instead of two.

A training step peaks higher the second time: the optimizer state, made during the first
step's optimizer step, exists through all of the second, and the first step's output is alive
until the second forward returns. Nothing else differs, so the first step's timeline of live
bytes gives the second's: at each moment of the first step add what, in the second, already
exists then. What survives the first step (after ``zero_grad(set_to_none=True)``, which the next
step starts with) is of two kinds, told apart by dropping the loop's output:

* what dies with the output (the logits, a ``ModelOutput``): alive in the second step until its
  forward returns;
* the rest (optimizer state, caches a model keeps, cuBLAS's workspaces): alive all through it.

The peak is the largest of these sums; running a second step on fake tensors costs as much as
the first (an RNN's per-timestep ops: seconds), reading it costs a pass over the timeline.
Checked against two fake steps run (tests/memory/test_steady_state.py): the same peak on the
estimate's zoo (an LSTM's included, since the fake oneDNN backward returns its two bias
gradients as two tensors, as the real one does: :mod:`.real_kernels`) and on 198 transformers
architectures (causal LM, masked LM, seq2seq, image classification).

Usage (what :func:`~devicekit.memory.fake_step.fake_step` does)::

    timeline = Timeline(PARTS)
    tracker.timeline = timeline              # LiveBytes calls timeline.born / timeline.note
    out = training_step(...)                 # the first step, recorded
    timeline.forward_returned()              # from a forward hook: when `out` would be rebound
    peak, parts, phase = timeline.second_step(drop_grads, drop_output)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Timeline"]


class Timeline:
    """Live bytes by part after every new storage of one step, and when each storage was born.

    The :class:`~devicekit.memory.fake_step.LiveBytes` tracker calls :meth:`born` and
    :meth:`note`; ``storage_parts`` names its parts backed by storages (others, such as cuBLAS's
    workspaces, are counters that only grow).
    """

    def __init__(self, storage_parts: tuple[str, ...]) -> None:
        self.storage_parts = storage_parts
        self.events: list[tuple[dict[str, int], int, str]] = []   # (parts, transient, phase)
        self._born: WeakIdKeyDictionary = WeakIdKeyDictionary()   # storage -> (event, [size, part])
        self._forward_end: int | None = None

    def born(self, storage: Any, info: list[Any]) -> None:
        """``storage`` is new (``info``: [bytes, part], kept up to date by the tracker)."""
        self._born[storage] = (len(self.events), info, info[1])

    def note(self, live: dict[str, int], transient: int, phase: str) -> None:
        """The live bytes by part now (and ``transient`` bytes an op holds while it runs)."""
        self.events.append((dict(live), transient, phase))

    def forward_returned(self) -> None:
        """The model's first forward of the step has returned (the loop rebinds ``out`` then)."""
        if self._forward_end is None:
            self._forward_end = len(self.events)

    def _survivors(self) -> dict[int, tuple[int, list[Any], str]]:
        return {id(storage): value for storage, value in self._born.items()}

    def second_step(self, drop_grads: Callable[[], None], drop_output: Callable[[], None],
                    ) -> tuple[int, dict[str, int], str]:
        """(peak, parts at it, phase) of the next step, after the recorded one has ended.

        ``drop_grads()`` frees the gradients (as the next step's ``zero_grad`` does),
        ``drop_output()`` what the loop keeps of this step (as the next forward does).
        """
        drop_grads()
        survivors = self._survivors()
        drop_output()
        persistent = self._survivors()
        output = [value for key, value in survivors.items() if key not in persistent]
        del survivors
        forward_end = self._forward_end if self._forward_end is not None else len(self.events)
        # before the event a survivor was born at, the next step already holds it
        born_at: dict[int, dict[str, int]] = {}
        retagged: list[tuple[int, list[Any], str]] = []
        for event, info, first in persistent.values():
            parts = born_at.setdefault(event, {})
            parts[info[1]] = parts.get(info[1], 0) + info[0]
            if first != info[1]:
                retagged.append((event, info, first))
        kept: dict[str, int] = {}
        for _event, info, _first in output:
            kept[info[1]] = kept.get(info[1], 0) + info[0]
        last = self.events[-1][0] if self.events else {}
        counters = [part for part in last if part not in self.storage_parts]
        kept_total = sum(kept.values())
        pending_total = sum(size for born in born_at.values() for size in born.values())
        best, at = -1, -1
        for index, (live, transient, _phase) in enumerate(self.events):
            for size in born_at.get(index, {}).values():         # born now: in `live` from here on
                pending_total -= size
            total = sum(live.values()) + pending_total + transient
            total += kept_total if index < forward_end else 0
            total += sum(last[part] - live.get(part, 0) for part in counters)
            if total > best:
                best, at = total, index
        parts = self._parts_at(at, born_at, kept if at < forward_end else {}, counters)
        for event, info, first in retagged:
            # optimizer state is made as a temporary and named at the optimizer step's end: in
            # the next step it is optimizer state from the start
            if event <= at:
                parts[first] -= info[0]
                parts[info[1]] = parts.get(info[1], 0) + info[0]
        return best, parts, self.events[at][2]

    def _parts_at(self, at: int, born_at: dict[int, dict[str, int]], kept: dict[str, int],
                  counters: list[str]) -> dict[str, int]:
        live, transient, _phase = self.events[at]
        parts = dict(live)
        for event, born in born_at.items():
            if event > at:                                      # the next step holds it already
                for part, size in born.items():
                    parts[part] = parts.get(part, 0) + size
        for part, size in kept.items():
            parts[part] = parts.get(part, 0) + size
        for part in counters:                                   # workspaces made in this step
            parts[part] = self.events[-1][0][part]
        if transient:
            counter = counters[0] if counters else self.storage_parts[-1]
            parts[counter] = parts.get(counter, 0) + transient
        return parts

