"""Find a model's repeated blocks: the units FSDP shards one by one (and gathers one at a time).

The repeated blocks are the instances of the module class that occurs at least twice and, of
all such classes, holds the most parameters (the outermost one on a tie): the layers of a
transformer, the residual stages of a CNN, the ``Linear`` layers of an MLP. Or name them:
dotted module names (``"layers.0"``), a class, or a class name.

Usage::

    from devicekit.parallel.blocks import find_blocks

    names = [name for name, _ in find_blocks(model)]             # ["layers.0", "layers.1", ...]
    find_blocks(model, "TransformerEncoderLayer")
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from torch import nn

from devicekit.errors import InvalidValueError

__all__ = ["find_blocks", "BlockSpec"]

BlockSpec = str | type | Sequence[str] | None
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module, blocks: BlockSpec = None) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model`` as (dotted name, module), in module order; [] when none repeat."""
    named = [(n, m) for n, m in model.named_modules() if n]
    if blocks is None:
        groups: dict[type, list[tuple[str, nn.Module]]] = defaultdict(list)
        for name, module in named:
            if not isinstance(module, _CONTAINERS) and _params(module):
                groups[type(module)].append((name, module))
        repeated = [g for g in groups.values() if len(g) >= 2]
        if not repeated:
            return []
        best = max(repeated, key=lambda g: (sum(_params(m) for _, m in g), -min(n.count(".") for n, _ in g)))
        return _outermost(best)
    if isinstance(blocks, type) or (isinstance(blocks, str) and "." not in blocks and not blocks.isdigit()
                                    and blocks not in dict(named)):
        wanted = [(n, m) for n, m in named
                  if (isinstance(m, blocks) if isinstance(blocks, type) else type(m).__name__ == blocks)]
        if not wanted:
            kinds = sorted({type(m).__name__ for _, m in named})
            raise InvalidValueError(f"blocks {getattr(blocks, '__name__', blocks)!r} matches no module; "
                                    f"the model has {', '.join(kinds[:12])}")
        return _outermost(wanted)
    names = [blocks] if isinstance(blocks, str) else list(blocks)
    table = dict(named)
    missing = [n for n in names if n not in table]
    if missing:
        raise InvalidValueError(f"blocks {missing} are not modules of {type(model).__name__}; "
                                f"its modules include {[n for n, _ in named][:8]}")
    return [(n, table[n]) for n in names]


def _outermost(found: list[tuple[str, Any]]) -> list[tuple[str, nn.Module]]:
    """Drop blocks nested inside another chosen block (FSDP would wrap them twice)."""
    kept: list[tuple[str, nn.Module]] = []
    for name, module in found:
        if not any(name.startswith(other + ".") for other, _ in kept):
            kept.append((name, module))
    return kept
