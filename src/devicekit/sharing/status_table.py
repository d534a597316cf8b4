"""The utilization table: GPUtil's ``showUtilization()`` done right, plus processes and leases.

One row per physical GPU (index, name, GPU-busy %, memory-bandwidth-busy %, memory used/total,
temperature, power, users, lease), then the processes holding GPU memory and the live devicekit
leases. ``devicekit status`` prints the same table. rich is imported only when drawing.

Usage::

    import devicekit as dk

    dk.show_utilization()                       # to stdout
    dk.show_utilization(all_processes=False)    # GPUs only
    dk.show_utilization(compact=True)           # one line per GPU
    dk.show_utilization(this_process=True, label=f"step {step}")  # one line: this process
    with open("gpus.txt", "w") as f:
        dk.show_utilization(file=f)
"""

from __future__ import annotations

import time
from typing import IO, TYPE_CHECKING, Any

from devicekit.hardware.printable import printable
from devicekit.units import format_duration, format_size

if TYPE_CHECKING:
    from rich.console import RenderableType

    from devicekit.hardware.capability import Capability
    from devicekit.hardware.gpu import GPU
    from devicekit.sharing.leases import LeaseRecord
    from devicekit.sharing.machine_status import StatusReport

__all__ = ["render_status", "console_width"]

_COMMAND_WIDTH = 60


def console_width(file: IO[str] | None) -> int | None:
    """Full terminal width on a terminal; a fixed, wide-enough width when writing to a file
    (``file=None`` is stdout, which a batch job redirects to its log)."""
    import sys

    isatty = getattr(file if file is not None else sys.stdout, "isatty", None)
    if not (callable(isatty) and isatty()):
        return 120
    return None


def render_status(report: StatusReport, *, all_processes: bool = True,
                  now: float | None = None) -> RenderableType:
    """A rich renderable of ``report``: header line, GPU table, processes and leases."""
    from rich.console import Group
    from rich.text import Text

    now = time.time() if now is None else now
    parts: list[Any] = [Text(_header(report), style="bold")]
    for warning in report.warnings:
        parts.append(Text(f"warning: {warning}", style="yellow"))
    if not report.gpus:
        if report.backend != "none":  # for "none" the warning above already says why
            parts.append(Text(f"no GPUs found (backend: {report.backend})"))
    else:
        parts.append(_gpu_table(report))
        if all_processes and any(g.processes for g in report.gpus):
            parts.append(_process_table(report))
    if report.leases:
        parts.append(_lease_table(report, now))
    for entry in report.queue:  # the fair queue (devicekit queue has the details)
        reserved = f", reserved {','.join(entry['reserved'])}" if entry["reserved"] else ""
        line = (f"queue: ticket {entry['ticket']} {entry['user']} asks {entry['gpus_asked']}"
                f" GPU(s){reserved}: {entry['reason']}")  # other users' text: shown inert
        parts.append(Text("".join(c if c.isprintable() else "?" for c in line)))
    return Group(*parts)


def _header(report: StatusReport) -> str:
    h = report.host
    bits = [h.hostname, f"backend {report.backend}"]
    if report.driver_version:
        cuda = f" (CUDA {report.cuda_driver_version})" if report.cuda_driver_version else ""
        bits.append(f"driver {report.driver_version}{cuda}")
    cpus = f"{h.cpu_count_logical} CPUs"
    if h.cpu_affinity is not None and len(h.cpu_affinity) != h.cpu_count_logical:
        cpus += f" ({len(h.cpu_affinity)} usable)"
    bits.append(cpus)
    if h.load_average:
        bits.append("load " + " ".join(f"{x:.2f}" for x in h.load_average))
    bits.append(f"RAM {format_size(h.memory_used)} / {format_size(h.memory_total)}")
    bits.append(time.strftime("%H:%M:%S", time.localtime(report.taken_at)))
    return "  ".join(bits)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}%"


def _util_style(value: float | None) -> str:
    if value is None:
        return "dim"
    return "red" if value >= 80 else "yellow" if value >= 30 else "green"


def _memory_cell(gpu: GPU) -> tuple[str, str]:
    share = gpu.memory_used / gpu.memory_total if gpu.memory_total else 0.0
    style = "red" if share >= 0.8 else "yellow" if share >= 0.3 else "green"
    if gpu.memory_total >= 2**30:  # "70.0/80 GiB": compact enough for an 80-column terminal
        text = f"{gpu.memory_used / 2**30:.1f}/{gpu.memory_total / 2**30:.0f} GiB"
    else:
        text = f"{format_size(gpu.memory_used)}/{format_size(gpu.memory_total)}"
    return text, style


def _power_cell(gpu: GPU) -> str:
    if gpu.power_draw is None:
        return "n/a"
    limit = f"/{gpu.power_limit:.0f}" if gpu.power_limit is not None else ""
    return f"{gpu.power_draw:.0f}{limit} W"


def _users(gpu: GPU) -> str:
    if not gpu.processes:
        return "-"
    users = sorted({printable(p.user or "?") for p in gpu.processes})
    return f"{len(gpu.processes)}: " + ",".join(users)


def _lease_cell(leases: list[LeaseRecord]) -> str:
    if not leases:
        return "-"
    if len(leases) == 1:
        r = leases[0]
        mem = f" {format_size(r.memory)}" if r.memory is not None else ""
        return f"{printable(r.user)} ({r.pid}){mem}" + (" shared" if r.share else "")
    users = sorted({printable(r.user) for r in leases})
    total = sum(r.memory or 0 for r in leases)
    mem = f" {format_size(total)}" if total else ""
    return f"{len(leases)} shared: {','.join(users)}{mem}"


_GPU_HEADERS = ("GPU", "Name", "Util", "Mem-BW", "Memory used", "Temp", "Power", "TFLOP/s",
                "Users", "Lease")
_RIGHT = {0, 2, 3, 4, 5, 6, 7}
# column -> narrowest width, in the order they give way (the GPU name last); with an ellipsis
_FLEXIBLE = {9: 5, 8: 5, 1: 10}


def _gpu_rows(report: StatusReport) -> list[list[tuple[str, str]]]:
    from devicekit.hardware.capability import capabilities
    from devicekit.sharing.machine_status import leases_by_gpu

    grouped, _ = leases_by_gpu(report.gpus, report.leases)
    scores = capabilities(report.gpus)
    rows = []
    for gpu, cap in zip(report.gpus, scores, strict=True):
        memory, memory_style = _memory_cell(gpu)
        name = printable(gpu.name) + (f" [MIG x{len(gpu.mig_devices)}]" if gpu.mig_enabled else "")
        rows.append([
            (str(gpu.index), ""),
            (name, ""),
            (_pct(gpu.utilization), _util_style(gpu.utilization)),
            (_pct(gpu.memory_bandwidth_utilization),
             _util_style(gpu.memory_bandwidth_utilization)),
            (memory, memory_style),
            ("n/a" if gpu.temperature is None else f"{gpu.temperature}C", ""),
            (_power_cell(gpu), ""),
            _speed_cell(cap),
            (_users(gpu), ""),
            ("blocked", "bold red") if gpu.uuid in report.blocked else
            (_lease_cell([r for r in grouped.get(gpu.uuid, []) if r.gpu_uuid == gpu.uuid]), ""),
        ])
        rows.extend(_mig_rows(gpu, grouped.get(gpu.uuid, [])))
    return rows


def _mig_rows(gpu: GPU, leases: list[LeaseRecord]) -> list[list[tuple[str, str]]]:
    """One row per MIG instance under its GPU: ``2/0  └ MIG 1g.10gb``, its memory and lease."""
    from devicekit.hardware.mig import instance_device

    rows = []
    for mig in gpu.mig_devices:
        memory, memory_style = _memory_cell(instance_device(gpu, mig))
        rows.append([
            (f"{gpu.index}/{mig.index}", "dim"), (f"└ MIG {printable(mig.name)}", ""), ("", ""), ("", ""),
            (memory, memory_style), ("", ""), ("", ""), ("", ""), ("", ""),
            (_lease_cell([r for r in leases if r.gpu_uuid == mig.uuid]), ""),
        ])
    return rows


def _speed_cell(cap: Capability) -> tuple[str, str]:
    """16-bit matmul TFLOP/s: measured (bench, bold), datasheet (table) or estimated (``~``)."""
    if cap.source == "unknown":
        return "n/a", "dim"
    if cap.source == "bench":
        return f"{cap.score:.0f}", "bold"
    return (f"{cap.score:.0f}", "") if cap.source == "table" else (f"~{cap.score:.0f}", "dim")


def fit_widths(natural: list[int], minimum: dict[int, int], budget: int) -> list[int]:
    """Shrink flexible columns to fit ``budget``: each in ``minimum``'s order, down to its minimum."""
    widths = list(natural)
    for column, narrowest in minimum.items():
        excess = sum(widths) - budget
        if excess <= 0:
            break
        widths[column] = max(narrowest, widths[column] - excess)
    return widths


class _GPUTable:
    """The GPU table, sized to the console: numbers keep their width, text columns shrink."""

    def __init__(self, report: StatusReport) -> None:
        self.rows = _gpu_rows(report)

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.table import Table
        from rich.text import Text

        budget = options.max_width - 2 * (len(_GPU_HEADERS) - 1)  # one space each side of a cell
        rows = self.rows
        widths = fit_widths(_natural(rows), _FLEXIBLE, budget)
        if widths[1] < _natural(rows)[1]:  # too narrow: drop the "NVIDIA " every name starts with
            rows = [[row[0], (row[1][0].removeprefix("NVIDIA "), row[1][1]), *row[2:]]
                    for row in rows]
            widths = fit_widths(_natural(rows), _FLEXIBLE, budget)
        table = Table(box=None, pad_edge=False, header_style="bold")
        for i, header in enumerate(_GPU_HEADERS):
            table.add_column(header, justify="right" if i in _RIGHT else "left", no_wrap=True,
                             overflow="ellipsis", width=widths[i])
        for row in rows:
            table.add_row(*(Text(text, style=style) for text, style in row))
        yield table


def _natural(rows: list[list[tuple[str, str]]]) -> list[int]:
    return [max([len(h)] + [len(row[i][0]) for row in rows]) for i, h in enumerate(_GPU_HEADERS)]


def _gpu_table(report: StatusReport) -> Any:
    return _GPUTable(report)


def _short(command: str | None) -> str:
    if not command:
        return "?"
    command = printable(command)  # another user's text: escapes shown, never obeyed
    return command if len(command) <= _COMMAND_WIDTH else command[: _COMMAND_WIDTH - 1] + "…"


def _process_table(report: StatusReport) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="Processes", title_justify="left", box=None, pad_edge=False,
                  header_style="bold")
    table.add_column("GPU", justify="right")
    table.add_column("PID", justify="right")
    table.add_column("User")
    table.add_column("GPU memory", justify="right")
    table.add_column("Command", overflow="ellipsis")
    for gpu in report.gpus:
        for proc in gpu.processes:
            table.add_row(str(gpu.index), str(proc.pid), Text(printable(proc.user or "?")),
                          format_size(proc.memory) if proc.memory is not None else "n/a",
                          Text(_short(proc.command)))
    return table


def _lease_table(report: StatusReport, now: float) -> Any:
    from rich.table import Table
    from rich.text import Text

    from devicekit.sharing.machine_status import leases_by_gpu

    index_of = {g.uuid: g.index for g in report.gpus}
    mig_of = {m.uuid: m.index for g in report.gpus for m in g.mig_devices}
    grouped, orphans = leases_by_gpu(report.gpus, report.leases)
    rows = sorted(((index_of[uuid], r) for uuid, records in grouped.items() for r in records),
                  key=lambda row: (row[0], row[1].since))
    labelled = [(f"{index}/{mig_of[r.gpu_uuid]}" if r.gpu_uuid in mig_of else str(index), r)
                for index, r in rows]
    labelled += [(r.gpu_uuid, r) for r in orphans]  # a GPU no longer present: show its UUID
    table = Table(title="Leases", title_justify="left", box=None, pad_edge=False,
                  header_style="bold")
    table.add_column("GPU", justify="right")
    table.add_column("User")
    table.add_column("Host")
    table.add_column("PID", justify="right")
    table.add_column("Job")
    table.add_column("Held for", justify="right")
    table.add_column("Memory", justify="right")
    table.add_column("Command", overflow="ellipsis")
    for gpu_label, r in labelled:
        stopped = report.stopped.get(r.pid)
        table.add_row(Text(printable(gpu_label)), Text(printable(r.user)), Text(printable(r.host)),
                      str(r.pid) + (" stopped" if stopped is not None else ""),
                      Text(printable(r.job) if r.job else "-"), format_duration(now - r.since),
                      (format_size(r.memory) if r.memory is not None else "whole GPU")
                      + (" (shared)" if r.share else ""),
                      Text(_short(r.command) if r.kind == "lease"
                           else f"(lock only) {_short(r.command)}"))
    return table

