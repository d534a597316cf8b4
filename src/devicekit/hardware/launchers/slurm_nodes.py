"""Slurm's host lists and task counts: ``gpu[01-03,07]`` and ``2(x3),1``, parsed without ``scontrol``.

Usage::

    from devicekit.hardware.launchers.slurm_nodes import expand_nodelist, tasks_per_node

    expand_nodelist("gpu[01-03,07],login1")   # ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1']
    tasks_per_node("2(x3),1")                 # [2, 2, 2, 1]
"""

from __future__ import annotations

import itertools
import re

from devicekit.errors import DistributedError

__all__ = ["expand_nodelist", "tasks_per_node"]


def tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE such as ``"2(x3),1"`` into ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            raise DistributedError(
                f"SLURM_TASKS_PER_NODE={spec!r} cannot be parsed (expected e.g. '2(x3),1')"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list (``"a[1-3,5],b-[01-02]-ib,c"``) into host names, in order.

    Several bracket groups in one name expand as a product (``r[1-2]n[1-2]`` gives four
    hosts); zero padding follows the range's first number, as Slurm does.
    """
    hosts: list[str] = []
    for name in _split_top_level(nodelist):
        pieces = re.split(r"(\[[^\]]*\])", name)
        choices: list[list[str]] = []
        for piece in pieces:
            if piece.startswith("["):
                choices.append(_expand_brackets(nodelist, piece[1:-1]))
            elif "[" in piece or "]" in piece:
                raise DistributedError(f"node list {nodelist!r} has an unbalanced bracket")
            else:
                choices.append([piece])
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    names, depth, current = [], 0, []
    for char in nodelist.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise DistributedError(f"node list {nodelist!r} has an unbalanced bracket")
        if (char == "," or char.isspace()) and depth == 0:  # "a,b" or "a b c"
            names.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise DistributedError(f"node list {nodelist!r} has an unbalanced bracket")
    names.append("".join(current))
    return [n.strip() for n in names if n.strip()]


def _expand_brackets(nodelist: str, inner: str) -> list[str]:
    values: list[str] = []
    for item in inner.split(","):
        item = item.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if match is None:
            raise DistributedError(
                f"node list {nodelist!r}: range {item!r} is not a number or 'a-b'"
            )
        start, end = match.group(1), match.group(2)
        if end is None:
            values.append(start)
            continue
        if int(end) < int(start):
            raise DistributedError(f"node list {nodelist!r}: range {item!r} runs backwards")
        width = len(start)
        values.extend(str(n).zfill(width) for n in range(int(start), int(end) + 1))
    return values
