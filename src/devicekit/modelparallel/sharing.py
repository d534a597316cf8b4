"""Layers that must stay on one device: repeated layer objects and shared (tied) parameters.

A layer object listed twice in an ``nn.Sequential`` (``nn.Sequential(l, l)``) runs twice but
has one set of parameters; two layers may also hold the same parameter or buffer (tied
embeddings). Parameters live on one device, so no cut between parts on *different* devices may
fall between two uses of one object: each such object spans layers ``first .. last`` and those
layers are kept together. Parts on the same device may share freely (one memory), except across
processes, where every part is a separate copy. :func:`find_spans` finds the spans,
:func:`blocks` merges them into atomic runs of layers for the balancers, and :func:`check_cuts`
refuses explicit layer counts that would cut a span, naming the layer or parameter.

Usage::

    from torch import nn
    from devicekit.modelparallel.sharing import find_spans, blocks

    lin = nn.Linear(2, 2)
    layers = [("0", lin), ("1", nn.ReLU()), ("2", lin)]
    spans = find_spans(layers)      # [Span(first=0, last=2, what="layer '0' repeats as '2'")]
    blocks(3, spans)                # [(0, 3)]: one block of three layers
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from devicekit.errors import SplitError

__all__ = ["Span", "find_spans", "blocks", "expand_counts", "block_costs", "check_cuts", "must_keep_together"]


@dataclass(frozen=True)
class Span:
    """Layers ``first .. last`` (inclusive) use one object; ``what`` names it."""

    first: int
    last: int
    what: str


def find_spans(layers: Sequence[tuple[str, nn.Module]]) -> list[Span]:
    """Every object (layer, parameter, buffer) used by more than one layer position."""
    names = [name for name, _ in layers]
    layer_at: dict[int, list[int]] = {}
    tensor_at: dict[int, list[tuple[int, str]]] = {}
    for i, (_, layer) in enumerate(layers):
        layer_at.setdefault(id(layer), []).append(i)
        owned: dict[int, str] = {}
        for kind, found in (("parameter", layer.named_parameters()), ("buffer", layer.named_buffers())):
            for pname, tensor in found:
                if isinstance(tensor, torch.Tensor):
                    owned.setdefault(id(tensor), f"{kind} '{names[i]}.{pname}'")
        for key, label in owned.items():
            tensor_at.setdefault(key, []).append((i, label))
    spans: dict[tuple[int, int], str] = {}
    for places in layer_at.values():
        if len(places) > 1:
            others = ", ".join(f"'{names[p]}'" for p in places[1:])
            spans.setdefault((places[0], places[-1]), f"layer '{names[places[0]]}' repeats as {others}")
    for uses in tensor_at.values():
        positions = sorted({i for i, _ in uses})
        if len(positions) > 1:
            kind, _, first = uses[0][1].partition(" ")
            others = ", ".join(label.partition(" ")[2] for _, label in uses[1:])
            layers_named = ", ".join(f"'{names[p]}'" for p in positions)
            spans.setdefault((positions[0], positions[-1]),
                             f"{kind} {first} is shared (tied) with {others}, used by layers {layers_named}")
    return [Span(first, last, what) for (first, last), what in sorted(spans.items())]


def blocks(count: int, spans: Sequence[Span]) -> list[tuple[int, int]]:
    """``count`` layers as consecutive ``(start, stop)`` blocks no span crosses."""
    reach = list(range(count))  # reach[i]: the last layer that must join layer i's block
    for span in spans:
        reach[span.first] = max(reach[span.first], span.last)
    out: list[tuple[int, int]] = []
    start, end = 0, -1
    for i in range(count):
        end = max(end, reach[i])
        if i == end:
            out.append((start, i + 1))
            start = i + 1
    return out


def block_costs(costs: Sequence[float], spans_blocks: Sequence[tuple[int, int]]) -> list[float]:
    """Each block's summed cost."""
    return [float(sum(costs[a:b])) for a, b in spans_blocks]


def expand_counts(block_counts: Sequence[int], spans_blocks: Sequence[tuple[int, int]]) -> list[int]:
    """Blocks per part -> layers per part."""
    out, i = [], 0
    for n in block_counts:
        out.append(sum(b - a for a, b in spans_blocks[i:i + n]))
        i += n
    return out


def must_keep_together(devices: Sequence[torch.device], *, separate: bool = False) -> bool:
    """Whether shared objects constrain the cuts: parts on different devices (or processes)."""
    return separate or len(set(devices)) > 1


def check_cuts(spans: Sequence[Span], counts: Sequence[int], devices: Sequence[torch.device],
               *, separate: bool = False) -> None:
    """Refuse layer counts that put one shared object's uses on two devices (or processes)."""
    start = 0
    for k in range(len(counts) - 1):
        start += counts[k]
        cut = start  # parts k and k+1 meet between layers cut-1 and cut
        if not separate and devices[k] == devices[k + 1]:
            continue
        for span in spans:
            if span.first < cut <= span.last:
                where = "processes" if separate else f"devices {devices[k]} and {devices[k + 1]}"
                raise SplitError(
                    f"{span.what}, so layers {span.first}..{span.last} must stay on one device, but "
                    f"the cut after layer {cut - 1} puts them on {where}; choose counts that keep "
                    "them together or untie the parameter"
                )
