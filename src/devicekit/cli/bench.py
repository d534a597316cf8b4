"""``devicekit bench``: how fast each device is, beside its datasheet peak.

Usage::

    devicekit bench --quick                 # CPU and every GPU, a few seconds
    devicekit bench --device cuda:0 --json  # one GPU, as JSON
    devicekit bench --plot bench.png        # matmul throughput vs size
"""

from __future__ import annotations

import json
import sys

import click

__all__ = ["command"]

HELP = """Measure each device: matmul TFLOP/s per dtype and size (and where a GPU overtakes the
CPU), host<->device bandwidth (pinned and pageable), copy bandwidth within a device and between
GPUs (P2P), launch latency, .item() per step vs dk.MetricLog, and N GPUs at once vs in
sequence; each beside the known peak. Results are cached per GPU UUID, so
'devicekit select --order fastest' and 'devicekit run' use them. The full run takes under a
minute per GPU, --quick a few seconds (longer while other work keeps the CPU busy).
"""


@click.command(name="bench", help=HELP)
@click.option("--device", "devices", multiple=True, metavar="DEVICE",
              help="cpu, cuda (every GPU), all, cuda:N or N; repeat or comma-separate "
                   "(default: the CPU and every GPU).")
@click.option("--quick", is_flag=True,
              help="Fewer sizes, smaller buffers, fewer rounds: a few seconds on an idle machine.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON (schema 1).")
@click.option("--plot", "plot", metavar="FILE", help="Also draw matmul throughput into FILE (.png, .svg, .pdf).")
@click.option("--no-cache", is_flag=True, help="Do not record the results for selection.")
def command(devices: tuple[str, ...], quick: bool, as_json: bool, plot: str | None,
            no_cache: bool) -> int:
    from devicekit.cli.phases import PhaseStatus

    with PhaseStatus("bench") as status:
        status.phase("importing torch")
        from devicekit.measure.bench_runner import bench
        from devicekit.measure.plot import check_plot_path, save_plot

    if plot is not None:
        check_plot_path(plot)  # a bad file name fails before a minute of measuring
    if sys.stderr.isatty():  # bench's own progress bar
        report = bench(list(devices) or None, quick=quick, progress=None, cache=not no_cache)
    else:  # a log: a line for each measurement that lasts (and now and then)
        with PhaseStatus("bench") as status:
            report = bench(list(devices) or None, quick=quick, progress=status.phase, cache=not no_cache)
    if plot is not None:
        save_plot(report, plot)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        from devicekit.measure.bench_table import render_report

        render_report(report, sys.stdout)
        if plot is not None:
            click.echo(f"plot: {plot}")
    return 0
