"""The ``devicekit bench`` table: one block per device, figure, unit, peak and percent of peak.

Usage::

    from devicekit.measure.bench_table import render_report

    render_report(dk.bench(quick=True), sys.stdout)
"""

from __future__ import annotations

from typing import IO

from devicekit.measure.report import BenchReport, Figure

__all__ = ["render_report", "format_value"]


def format_value(fig: Figure) -> str:
    if fig.unit == "TFLOP/s" and fig.value < 1:
        return f"{fig.value * 1000:.3g} GFLOP/s"
    if fig.key == "crossover":
        return f"n = {int(fig.value)}" if fig.detail.get("found") else "never (CPU faster)"
    if fig.unit == "s":
        return f"{fig.value * 1000:.1f} ms"
    if fig.unit == "x":
        return f"{fig.value:.2f}x"
    return f"{fig.value:.1f} {fig.unit}"


def _peak(fig: Figure) -> tuple[str, str]:
    if fig.peak is None:
        return "", ""
    if fig.unit == "x":
        return f"ideal {fig.peak:g}x", ""
    return f"{fig.peak:g} {fig.unit}", f"{fig.percent_of_peak:.0f}%"


def render_report(report: BenchReport, file: IO[str]) -> None:
    """Print ``report`` as rich tables to ``file``."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file)
    for note in report.notes:
        console.print(f"note: {note}")
    for dev in report.devices:
        title = f"{dev.device}: {dev.name}" + (
            f" (known as {dev.known_model})" if dev.known_model != "unknown" else
            (" (peak unknown)" if dev.device != "cpu" else ""))
        table = Table(title=title, title_justify="left", box=None, header_style="bold")
        for header, justify in (("measured", "left"), ("value", "right"), ("peak", "right"),
                                ("of peak", "right")):
            table.add_column(header, justify=justify)  # type: ignore[arg-type]
        for fig in dev.figures:
            table.add_row(fig.label, format_value(fig), *_peak(fig))
        console.print(table)
        for note in dev.notes:
            console.print(f"  note: {note}")
    if report.system:
        table = Table(title="between GPUs", title_justify="left", box=None, header_style="bold")
        for header in ("measured", "value", "ideal/peak"):
            table.add_column(header)
        for fig in report.system:
            table.add_row(fig.label, format_value(fig), _peak(fig)[0])
        console.print(table)
    console.print(f"{'quick ' if report.quick else ''}run took {report.seconds:.1f} s"
                  + (f"; cached in {len(report.cache_files)} file(s)" if report.cache_files else ""))
