"""The GPU table, rendered from the status document: one renderer for every view of it.

The document is ``devicekit status --json`` (:meth:`~devicekit.sharing.machine_status.
StatusReport.to_dict`), this machine's or a lab peer's (already checked by
:mod:`devicekit.serve.peer_document`). :func:`gpu_cells` turns one of its GPUs into the cells
every view shows (utilization, memory, users, lease with ``(lock)``/``shared``/``idle``, state);
:class:`GPUTable` draws rows of them sized to the console; :func:`render_status` is the whole
``devicekit status`` view (header, warnings, GPUs with their MIG instances, processes, leases,
the queue). ``status --hosts`` (:mod:`devicekit.serve.lab_table`) and the two pages
(:mod:`devicekit.serve.page`, :mod:`devicekit.serve.lab_page`) use the same cells. Every text
from the document is printed through :func:`~devicekit.hardware.printable.printable` (another
user's or host's text: shown, never obeyed), every number is checked before it is formatted.
rich is imported only when drawing.

Usage::

    from rich.console import Console
    from devicekit.sharing.machine_status import collect_status
    from devicekit.sharing.status_table import gpu_cells, render_status

    doc = collect_status().to_dict()
    Console().print(render_status(doc))
    gpu_cells(doc["gpus"][0])["lease"]      # ('bob (812) idle', '')
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

from devicekit.hardware.printable import printable
from devicekit.units import format_duration, format_size

if TYPE_CHECKING:
    from rich.console import RenderableType

    from devicekit.sharing.machine_status import StatusReport

__all__ = ["render_status", "console_width", "gpu_cells", "gpu_state", "lease_cell",
           "GPUTable", "COLUMNS", "fit_widths"]

#: a cell: its text and its rich style ("" for none)
Cell = tuple[str, str]
#: column key -> (header, right-aligned)
COLUMNS: dict[str, tuple[str, bool]] = {
    "host": ("Host", False), "gpu": ("GPU", True), "name": ("Name", False),
    "util": ("Util", True), "membw": ("Mem-BW", True), "memory": ("Memory used", True),
    "temp": ("Temp", True), "power": ("Power", True), "speed": ("TFLOP/s", True),
    "users": ("Users", False), "lease": ("Lease", False), "job": ("Job", False),
    "queue": ("Queue", False),
}
#: the columns of ``devicekit status`` and, narrowest widths in the order they give way
LOCAL = ("gpu", "name", "util", "membw", "memory", "temp", "power", "speed", "users", "lease")
_LOCAL_GIVE_WAY = {"lease": 5, "users": 5, "name": 10}
_COMMAND_WIDTH = 60


def _number(value: Any) -> float | None:
    """A finite number from the document, else None (a peer's NaN, a string, a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _size(value: Any) -> int:
    number = _number(value)
    return int(number) if number is not None and number >= 0 else 0


def console_width(file: IO[str] | None) -> int | None:
    """Full terminal width on a terminal; a fixed, wide-enough width when writing to a file
    (``file=None`` is stdout, which a batch job redirects to its log)."""
    import sys

    isatty = getattr(file if file is not None else sys.stdout, "isatty", None)
    if not (callable(isatty) and isatty()):
        return 120
    return None


def _pct(value: Any) -> Cell:
    number = _number(value)
    if number is None:
        return "n/a", "dim"
    return f"{number:.0f}%", "red" if number >= 80 else "yellow" if number >= 30 else "green"


def _memory(entry: Mapping[str, Any]) -> Cell:
    used, total = _size(entry.get("memory_used")), _size(entry.get("memory_total"))
    share = used / total if total else 0.0
    style = "red" if share >= 0.8 else "yellow" if share >= 0.3 else "green"
    if total >= 2**30:  # "70.0/80 GiB": compact enough for an 80-column terminal
        return f"{used / 2**30:.1f}/{total / 2**30:.0f} GiB", style
    return f"{format_size(used)}/{format_size(total)}", style


def _power(gpu: Mapping[str, Any]) -> str:
    draw, limit = _number(gpu.get("power_draw")), _number(gpu.get("power_limit"))
    if draw is None:
        return "n/a"
    return f"{draw:.0f}" + (f"/{limit:.0f}" if limit is not None else "") + " W"


def _speed(gpu: Mapping[str, Any]) -> Cell:
    """16-bit matmul TFLOP/s: measured (bench, bold), datasheet (table) or estimated (``~``)."""
    cap = gpu.get("capability") if isinstance(gpu.get("capability"), Mapping) else {}
    score, source = _number(cap.get("score")), cap.get("source")
    if score is None or not isinstance(source, str) or source == "unknown":
        return "n/a", "dim"
    if source == "bench":
        return f"{score:.0f}", "bold"
    return (f"{score:.0f}", "") if source == "table" else (f"~{score:.0f}", "dim")


def _users(gpu: Mapping[str, Any]) -> str:
    procs = [p for p in gpu.get("processes") or () if isinstance(p, Mapping)]
    if not procs:
        return "-"
    return f"{len(procs)}: " + ",".join(sorted({printable(p.get("user") or "?") for p in procs}))


def _leases(entry: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [r for r in entry.get("leases") or () if isinstance(r, Mapping)]


def _own_leases(gpu: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The GPU's leases without those of its MIG instances (the document lists both)."""
    migs = {m.get("uuid") for m in gpu.get("mig_devices") or () if isinstance(m, Mapping)}
    return [r for r in _leases(gpu) if r.get("gpu_uuid") not in migs or r.get("gpu_uuid") is None]


def lease_cell(leases: Sequence[Mapping[str, Any]]) -> str:
    """``bob (812) 20 GiB shared (lock) idle`` for one lease, ``2 shared: carol,dave 12 GiB``;
    ``2 leases: nobody`` when they are not all ``share`` leases (whole-GPU lease files that
    cannot all hold the lock, e.g. written by hand): never called shared when they are not."""
    if not leases:
        return "-"
    if len(leases) == 1:
        r = leases[0]
        memory = _number(r.get("memory"))
        return (f"{printable(r.get('user') or '?')} ({printable(r.get('pid'))})"
                + (f" {format_size(int(memory))}" if memory is not None and memory >= 0 else "")
                + (" shared" if r.get("share") is True else "")
                + (" (lock)" if r.get("kind") == "lock" else "")
                + (" idle" if _number(r.get("idle_since")) is not None else ""))
    users = ",".join(sorted({printable(r.get("user") or "?") for r in leases}))
    total = sum(_size(r.get("memory")) for r in leases)
    kind = "shared" if all(r.get("share") is True for r in leases) else "leases"
    return f"{len(leases)} {kind}: {users}" + (f" {format_size(total)}" if total else "")


def gpu_state(gpu: Mapping[str, Any]) -> str:
    """``blocked``, ``leased``, ``in use`` (processes, utilization or 5 % memory) or ``free``."""
    if gpu.get("blocked"):
        return "blocked"
    if _leases(gpu):
        return "leased"
    used, total = _size(gpu.get("memory_used")), _size(gpu.get("memory_total"))
    busy = gpu.get("processes") or (_number(gpu.get("utilization")) or 0) > 0 or \
        (total and used / total >= 0.05)
    return "in use" if busy else "free"


def gpu_cells(gpu: Mapping[str, Any]) -> dict[str, Cell]:
    """The cells of every column but host and queue for one GPU of a status document."""
    name = printable(gpu.get("name") or "?")
    if gpu.get("mig_enabled") is True:
        name += f" [MIG x{len(gpu.get('mig_devices') or ())}]"
    temp = _number(gpu.get("temperature"))
    own = _own_leases(gpu)
    jobs = ",".join(dict.fromkeys(printable(r.get("job") or "-") for r in own)) or "-"
    return {
        "gpu": (printable(gpu.get("index")), ""), "name": (name, ""),
        "util": _pct(gpu.get("utilization")), "membw": _pct(gpu.get("memory_bandwidth_utilization")),
        "memory": _memory(gpu), "temp": ("n/a" if temp is None else f"{temp:.0f}C", ""),
        "power": (_power(gpu), ""), "speed": _speed(gpu), "users": (_users(gpu), ""),
        "lease": ("blocked", "bold red") if gpu.get("blocked") else (lease_cell(own), ""),
        "job": ("-" if gpu.get("blocked") else jobs, ""),
    }


def _mig_cells(gpu: Mapping[str, Any]) -> list[dict[str, Cell]]:
    """One row per MIG instance under its GPU: ``2/0  └ MIG 1g.10gb``, its memory and lease."""
    rows = []
    for mig in gpu.get("mig_devices") or ():
        if not isinstance(mig, Mapping):
            continue
        leases = [r for r in _leases(gpu) if r.get("gpu_uuid") == mig.get("uuid")] \
            or _leases(mig)
        rows.append({
            "gpu": (f"{printable(gpu.get('index'))}/{printable(mig.get('index'))}", "dim"),
            "name": (f"└ MIG {printable(mig.get('name') or '?')}", ""),
            "memory": _memory(mig), "lease": (lease_cell(leases), ""),
            "job": (",".join(dict.fromkeys(printable(r.get("job") or "-") for r in leases))
                    or "-", ""),
        })
    return rows


def gpu_rows(doc: Mapping[str, Any]) -> list[dict[str, Cell]]:
    """Every GPU of ``doc`` and, under each, its MIG instances."""
    rows: list[dict[str, Cell]] = []
    for gpu in doc.get("gpus") or ():
        if isinstance(gpu, Mapping):
            rows.append(gpu_cells(gpu))
            rows.extend(_mig_cells(gpu))
    return rows


def fit_widths(natural: list[int], minimum: dict[int, int], budget: int) -> list[int]:
    """Shrink flexible columns to fit ``budget``: each in ``minimum``'s order, down to its minimum."""
    widths = list(natural)
    for column, narrowest in minimum.items():
        excess = sum(widths) - budget
        if excess <= 0:
            break
        widths[column] = max(narrowest, widths[column] - excess)
    return widths


class GPUTable:
    """Rows of cells in ``columns``, sized to the console: numbers keep their width, the text
    columns in ``give_way`` shrink in that order (with an ellipsis); when the name must shrink,
    the ``NVIDIA `` every name starts with goes first."""

    def __init__(self, rows: list[dict[str, Cell]], columns: Sequence[str] = LOCAL,
                 give_way: Mapping[str, int] | None = None) -> None:
        self.rows, self.columns = rows, tuple(columns)
        self.give_way = {self.columns.index(k): width for k, width in
                         (_LOCAL_GIVE_WAY if give_way is None else give_way).items()
                         if k in self.columns}

    def _natural(self, rows: list[list[Cell]]) -> list[int]:
        return [max([len(COLUMNS[key][0])] + [len(row[i][0]) for row in rows])
                for i, key in enumerate(self.columns)]

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.table import Table
        from rich.text import Text

        rows = [[row.get(key, ("", "")) for key in self.columns] for row in self.rows]
        budget = options.max_width - 2 * (len(self.columns) - 1)  # a space each side of a cell
        natural = self._natural(rows)
        widths = fit_widths(natural, self.give_way, budget)
        name = self.columns.index("name") if "name" in self.columns else None
        if name is not None and widths[name] < natural[name]:
            rows = [[*row[:name], (row[name][0].removeprefix("NVIDIA "), row[name][1]),
                     *row[name + 1:]] for row in rows]
            widths = fit_widths(self._natural(rows), self.give_way, budget)
        table = Table(box=None, pad_edge=False, header_style="bold")
        for i, key in enumerate(self.columns):
            header, right = COLUMNS[key]
            table.add_column(header, justify="right" if right else "left", no_wrap=True,
                             overflow="ellipsis", width=widths[i])
        for row in rows:
            table.add_row(*(Text(text, style=style) for text, style in row))
        yield table


def render_status(doc: Mapping[str, Any] | StatusReport, *, all_processes: bool = True,
                  now: float | None = None) -> RenderableType:
    """A rich renderable of a status document (or a report, read through its document):
    header line, warnings, GPU table, processes, leases and the queue."""
    from rich.console import Group
    from rich.text import Text

    if not isinstance(doc, Mapping):
        doc = doc.to_dict()
    now = time.time() if now is None else now
    parts: list[Any] = [Text(_header(doc), style="bold")]
    for warning in doc.get("warnings") or ():
        parts.append(Text(f"warning: {printable(warning)}", style="yellow"))
    gpus = [g for g in doc.get("gpus") or () if isinstance(g, Mapping)]
    if not gpus:
        if doc.get("backend") != "none":  # for "none" the warning above already says why
            parts.append(Text(f"no GPUs found (backend: {printable(doc.get('backend'))})"))
    else:
        parts.append(GPUTable(gpu_rows(doc)))
        if all_processes and any(g.get("processes") for g in gpus):
            parts.append(_process_table(gpus))
    leases = _lease_rows(doc)
    if leases:
        parts.append(_lease_table(leases, now))
    for entry in doc.get("queue") or ():  # the fair queue (devicekit queue has the details)
        if not isinstance(entry, Mapping):
            continue
        reserved = ",".join(printable(r) for r in entry.get("reserved") or ())
        parts.append(Text(printable(
            f"queue: ticket {entry.get('ticket')} {entry.get('user')} asks "
            f"{entry.get('gpus_asked')} GPU(s){f', reserved {reserved}' if reserved else ''}: "
            f"{entry.get('reason')}")))  # other users' text: shown inert
    return Group(*parts)


def _header(doc: Mapping[str, Any]) -> str:
    h = doc.get("host") if isinstance(doc.get("host"), Mapping) else {}
    bits = [printable(h.get("hostname") or "?"), f"backend {printable(doc.get('backend'))}"]
    if doc.get("driver_version"):
        cuda = doc.get("cuda_driver_version")
        bits.append(f"driver {printable(doc['driver_version'])}"
                    + (f" (CUDA {printable(cuda)})" if cuda else ""))
    cpus, affinity = _number(h.get("cpu_count_logical")), h.get("cpu_affinity")
    if cpus is not None:
        usable = f" ({len(affinity)} usable)" if isinstance(affinity, list) and \
            len(affinity) != cpus else ""
        bits.append(f"{cpus:.0f} CPUs{usable}")
    load = [_number(x) for x in h.get("load_average") or ()]
    if load and None not in load:
        bits.append("load " + " ".join(f"{x:.2f}" for x in load))  # type: ignore[str-format]
    bits.append(f"RAM {format_size(_size(h.get('memory_used')))} / "
                f"{format_size(_size(h.get('memory_total')))}")
    taken = _number(doc.get("taken_at"))
    if taken is not None and abs(taken) < 1e11:
        bits.append(time.strftime("%H:%M:%S", time.localtime(taken)))
    return "  ".join(bits)


def _short(command: Any) -> str:
    if not command:
        return "?"
    command = printable(command)  # another user's text: escapes shown, never obeyed
    return command if len(command) <= _COMMAND_WIDTH else command[: _COMMAND_WIDTH - 1] + "…"


def _table(title: str, headers: str) -> Any:
    """A titled table; a header ending in ``>`` is right-aligned."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=None, pad_edge=False, header_style="bold")
    for header in headers.split(","):
        table.add_column(header.rstrip(">"), justify="right" if header.endswith(">") else "left",
                         overflow="ellipsis")
    return table


def _process_table(gpus: list[Mapping[str, Any]]) -> Any:
    from rich.text import Text

    table = _table("Processes", "GPU>,PID>,User,GPU memory>,Command")
    for gpu in gpus:
        for proc in gpu.get("processes") or ():
            if isinstance(proc, Mapping):
                memory = _number(proc.get("memory"))
                table.add_row(printable(gpu.get("index")), printable(proc.get("pid")),
                              Text(printable(proc.get("user") or "?")),
                              format_size(int(memory)) if memory is not None else "n/a",
                              Text(_short(proc.get("command"))))
    return table


def _lease_rows(doc: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(device label, lease) for every lease: ``2``, ``2/0`` on a MIG instance, the UUID of a
    device no longer present; by GPU, then by age."""
    rows: list[tuple[tuple[float, float], str, Mapping[str, Any]]] = []
    for gpu in doc.get("gpus") or ():
        if not isinstance(gpu, Mapping):
            continue
        migs = {m.get("uuid"): m.get("index") for m in gpu.get("mig_devices") or ()
                if isinstance(m, Mapping)}
        index = _number(gpu.get("index"))
        for r in _leases(gpu):
            label = printable(gpu.get("index")) + (f"/{printable(migs[r.get('gpu_uuid')])}"
                                                    if r.get("gpu_uuid") in migs else "")
            rows.append(((index or 0.0, _number(r.get("since")) or 0.0), label, r))
    rows.sort(key=lambda row: row[0])
    others = [r for r in doc.get("other_leases") or () if isinstance(r, Mapping)]
    return [(label, r) for _, label, r in rows] + [(printable(r.get("gpu_uuid")), r)
                                                   for r in others]


def _lease_table(rows: list[tuple[str, Mapping[str, Any]]], now: float) -> Any:
    from rich.text import Text

    table = _table("Leases", "GPU>,User,Host,PID>,Job,Held for>,Memory>,Command")
    for label, r in rows:
        memory, since = _number(r.get("memory")), _number(r.get("since"))
        stopped = _number(r.get("stopped_since")) is not None
        command = _short(r.get("command"))
        table.add_row(Text(label), Text(printable(r.get("user") or "?")),
                      Text(printable(r.get("host") or "?")),
                      printable(r.get("pid")) + (" stopped" if stopped else ""),
                      Text(printable(r.get("job")) if r.get("job") else "-"),
                      format_duration(now - since) if since is not None else "?",
                      (format_size(int(memory)) if memory is not None else "whole GPU")
                      + (" (shared)" if r.get("share") is True else ""),
                      Text(command if r.get("kind") != "lock" else f"(lock only) {command}"))
    return table
