"""The usage table: :func:`report` prints :func:`devicekit.memory.usage` with rich.

Usage::

    import devicekit as dk

    dk.memory.report()            # one row per device, '-' where a figure was not measurable
"""

from __future__ import annotations

from typing import IO

from rich.console import Console
from rich.table import Table

from devicekit.memory.usage import DeviceMemory, usage
from devicekit.units import format_size

__all__ = ["report", "usage_table"]


def _size(value: int | None) -> str:
    return "-" if value is None else format_size(value)


def usage_table(rows: list[DeviceMemory]) -> Table:
    """A rich table of ``rows``; notes go in the caption so a '-' always says why."""
    table = Table(title="devicekit memory usage", title_justify="left")
    for column in ("device", "allocated", "reserved", "peak", "reserved unused", "free", "total", "RSS"):
        table.add_column(column, justify="left" if column == "device" else "right")
    notes: list[str] = []
    for row in rows:
        label = row.device if not row.name else f"{row.device} ({row.name})"
        table.add_row(
            label, _size(row.allocated), _size(row.reserved), _size(row.peak),
            _size(row.reserved_unused), _size(row.free), _size(row.total), _size(row.process_rss),
        )
        notes.extend(f"{row.device}: {note}" for note in row.notes)
    if notes:
        table.caption = "\n".join(notes)
        table.caption_justify = "left"
    return table


def report(device: str | int | None = None, *, file: IO[str] | None = None) -> list[DeviceMemory]:
    """Print the usage table (to ``file`` or stdout) and return the rows it shows."""
    rows = usage(device)
    Console(file=file, width=120).print(usage_table(rows))
    return rows
