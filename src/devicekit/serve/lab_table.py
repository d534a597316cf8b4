"""The lab table ``devicekit status --hosts`` prints: every host's GPUs in one table.

One row per GPU (and MIG instance) with a host column: the cells of
:func:`devicekit.sharing.status_table.gpu_cells`, the one renderer of a status document's GPUs
(name, utilization, memory used/total, the users of its processes, its lease with ``(lock)``
and ``idle``, the lease's job), and the host's queue length on its first row. A host that did not answer is one line under the table saying why; a host's warnings
follow, one line each. Everything read from a host is another machine's text: printed through
:func:`devicekit.hardware.printable.printable` (control characters shown, never obeyed) and
already bounded by :mod:`~devicekit.serve.peer_document`. rich is imported only when drawing.

Usage::

    from rich.console import Console
    from devicekit.serve.lab import PeerReader
    from devicekit.serve.lab_table import render_lab

    Console().print(render_lab(PeerReader().read(peers)))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from devicekit.hardware.printable import printable
from devicekit.serve.lab import HostAnswer
from devicekit.serve.people import queue_tickets
from devicekit.sharing.status_table import GPUTable, gpu_rows

__all__ = ["render_lab", "COLUMNS"]

#: the lab's columns (:data:`devicekit.sharing.status_table.COLUMNS` names them)
COLUMNS = ("host", "gpu", "name", "util", "memory", "users", "lease", "job", "queue")
# column -> narrowest width, in the order they give way (the GPU name last)
_GIVE_WAY = {"job": 6, "users": 6, "lease": 10, "name": 8}
#: how many warnings of one host are printed
_WARNINGS_SHOWN = 3


def render_lab(answers: Sequence[HostAnswer]) -> Any:
    """A rich renderable: the table of every answering host's GPUs, then a line per host that
    did not answer and per warning."""
    from rich.console import Group
    from rich.text import Text

    rows: list[dict[str, tuple[str, str]]] = []
    notes: list[Any] = []
    for answer in answers:
        label = printable(answer.label)
        if answer.status is None:
            notes.append(Text(f"{label}: {printable(answer.error or 'no answer')}", style="red"))
            continue
        if answer.error:
            notes.append(Text(f"{label}: {printable(answer.error)} (showing its last answer)",
                              style="red"))
        waiting = len(queue_tickets(answer.status))
        queue = f"{waiting} waiting" if waiting else "-"
        host_rows = gpu_rows(answer.status) or [{"name": ("no GPUs", "")}]
        host_rows[0] = {**host_rows[0], "host": (label, ""), "queue": (queue, "")}
        rows.extend(host_rows)
        warnings = answer.status.get("warnings") or []
        for warning in warnings[:_WARNINGS_SHOWN]:
            notes.append(Text(f"{label}: warning: {printable(warning)}", style="yellow"))
        if len(warnings) > _WARNINGS_SHOWN:
            notes.append(Text(f"{label}: {len(warnings) - _WARNINGS_SHOWN} more warning(s): "
                              "devicekit status on it", style="yellow"))
    answered = sum(1 for a in answers if a.status is not None)
    head = Text(f"{answered} of {len(answers)} host(s) answered", style="bold")
    table = GPUTable(rows, COLUMNS, _GIVE_WAY)
    return Group(head, table, *notes) if answered else Group(head, *notes)
