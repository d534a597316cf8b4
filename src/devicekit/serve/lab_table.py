"""The lab table ``devicekit status --hosts`` prints: every host's GPUs in one table.

One row per GPU with a host column: name, utilization, memory used/total, the users of its
processes, its lease (user and pid) and the lease's job, and the host's queue length on its
first row. A host that did not answer is one line under the table saying why; a host's warnings
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
from devicekit.sharing.status_table import fit_widths
from devicekit.units import format_size

__all__ = ["render_lab", "gpu_row", "HEADERS"]

HEADERS = ("Host", "GPU", "Name", "Util", "Memory used", "Users", "Lease", "Job", "Queue")
_RIGHT = {1, 3, 4}
# column -> narrowest width, in the order they give way (the GPU name last)
_FLEXIBLE = {7: 6, 5: 6, 6: 10, 2: 8}
#: how many warnings of one host are printed
_WARNINGS_SHOWN = 3


def _memory(gpu: dict[str, Any]) -> str:
    used, total = int(gpu.get("memory_used") or 0), int(gpu.get("memory_total") or 0)
    if total >= 2**30:
        return f"{used / 2**30:.1f}/{total / 2**30:.0f} GiB"
    return f"{format_size(used)}/{format_size(total)}"


def _users(gpu: dict[str, Any]) -> str:
    procs = gpu.get("processes") or []
    if not procs:
        return "-"
    return f"{len(procs)}: " + ",".join(sorted({printable(p.get("user") or "?") for p in procs}))


def _lease(leases: list[dict[str, Any]]) -> tuple[str, str]:
    if not leases:
        return "-", "-"
    jobs = ",".join(dict.fromkeys(printable(lease.get("job") or "-") for lease in leases))
    if len(leases) == 1:
        lease = leases[0]
        idle = " idle" if lease.get("idle_since") is not None else ""
        lock = " (lock)" if lease.get("kind") == "lock" else ""
        return f"{printable(lease.get('user') or '?')} ({lease.get('pid')}){lock}{idle}", jobs
    users = ",".join(sorted({printable(lease.get("user") or "?") for lease in leases}))
    return f"{len(leases)} shared: {users}", jobs


def gpu_row(gpu: dict[str, Any]) -> list[str]:
    """The cells after the host column for one GPU of a checked status document."""
    util = gpu.get("utilization")
    name = printable(gpu.get("name") or "?").removeprefix("NVIDIA ")
    if gpu.get("mig_enabled"):
        name += f" [MIG x{len(gpu.get('mig_devices') or [])}]"
    lease, job = ("blocked", "-") if gpu.get("blocked") else _lease(gpu.get("leases") or [])
    return [str(gpu.get("index")), name, "n/a" if util is None else f"{float(util):.0f}%",
            _memory(gpu), _users(gpu), lease, job]


class _LabTable:
    """The table, sized to the console: host and numbers keep their width; the text columns
    (job, users, lease, name) give way first, cut with an ellipsis."""

    def __init__(self, rows: list[list[str]]) -> None:
        self.rows = rows

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.table import Table
        from rich.text import Text

        natural = [max([len(h)] + [len(row[i]) for row in self.rows])
                   for i, h in enumerate(HEADERS)]
        budget = options.max_width - 2 * (len(HEADERS) - 1)  # one space each side of a cell
        widths = fit_widths(natural, _FLEXIBLE, budget)
        table = Table(box=None, pad_edge=False, header_style="bold")
        for i, header in enumerate(HEADERS):
            table.add_column(header, justify="right" if i in _RIGHT else "left", no_wrap=True,
                             overflow="ellipsis", width=widths[i])
        for row in self.rows:
            table.add_row(*(Text(cell) for cell in row))
        yield table


def render_lab(answers: Sequence[HostAnswer]) -> Any:
    """A rich renderable: the table of every answering host's GPUs, then a line per host that
    did not answer and per warning."""
    from rich.console import Group
    from rich.text import Text

    rows: list[list[str]] = []
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
        gpus = answer.status.get("gpus") or []
        if not gpus:
            rows.append([label, "", "no GPUs", "", "", "", "", "", queue])
        for n, gpu in enumerate(gpus):
            rows.append([label if n == 0 else "", *gpu_row(gpu), queue if n == 0 else ""])
        warnings = answer.status.get("warnings") or []
        for warning in warnings[:_WARNINGS_SHOWN]:
            notes.append(Text(f"{label}: warning: {printable(warning)}", style="yellow"))
        if len(warnings) > _WARNINGS_SHOWN:
            notes.append(Text(f"{label}: {len(warnings) - _WARNINGS_SHOWN} more warning(s): "
                              "devicekit status on it", style="yellow"))
    answered = sum(1 for a in answers if a.status is not None)
    head = Text(f"{answered} of {len(answers)} host(s) answered", style="bold")
    return Group(head, _LabTable(rows), *notes) if answered else Group(head, *notes)
