"""What the ranks' stack dumps say: the dumps ``dk.launch`` asks a stuck rank for (faulthandler,
on a signal) and the tracebacks of a failed rank, read without trusting them to be whole.

Usage::

    from devicekit.jobs.rank_stacks import complete, in_collective, innermost_frame, read_text

    text = read_text("/tmp/job/rank1.stack")
    if complete(text):
        print(innermost_frame(text))     # "train.py:42 in step"
"""

from __future__ import annotations

import os
import re

__all__ = ["in_collective", "innermost_frame", "complete", "read_text"]


def in_collective(text: str) -> bool:
    """True for a traceback that goes through torch.distributed (most likely a broken collective)."""
    return "torch/distributed" in text.replace("\\", "/")


def innermost_frame(stack: str) -> str:
    """``file:line in function`` of the innermost frame of the main thread in a faulthandler dump."""
    lines = stack.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    for line in lines[(start or 0) + 1 :]:
        match = re.match(r'\s*File "(.+)", line (\d+) in (\S+)', line)
        if match:
            return f"{os.path.basename(match.group(1))}:{match.group(2)} in {match.group(3)}"
    return ""


def complete(stack: str) -> bool:
    """True once a faulthandler dump has reached the main thread's outermost frame."""
    return "Current thread" in stack and stack.rstrip().endswith("in <module>")


def read_text(path: str) -> str:
    """The file's text, at most 1 MiB (\"\" when it cannot be read: a rank that never wrote it)."""
    from devicekit.jobs.rank_files import read_rank_text

    return read_rank_text(path)
