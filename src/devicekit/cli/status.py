"""``devicekit status``: every GPU, its memory, utilization, processes, users and leases.

Formatting only: the facts come from :func:`devicekit.sharing.machine_status.collect_status`, the table
from :func:`devicekit.sharing.status_table.render_status`, the JSON from ``StatusReport.to_dict``
(schema in docs/cli.md). No torch import, so it starts fast.

Usage::

    devicekit status
    devicekit status --json | jq '.gpus[] | {index, memory_free, leases}'
    devicekit status --watch          # refresh every 2 s until Ctrl-C
    devicekit status --watch 0.5 --json   # one JSON document per line, every 0.5 s
    devicekit status --hosts gpu1:9400,gpu2:9400   # the lab: every host's devicekit serve
    devicekit status --hosts                       # hosts from DEVICEKIT_HOSTS or the hosts file

With ``--hosts`` the facts come from each host's ``devicekit serve`` (``/api/status``), read by
:class:`devicekit.serve.lab.PeerReader`; the table is :func:`devicekit.serve.lab_table.render_lab`.
"""

from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import Iterator
from typing import Any

import click

from devicekit.cli.filters import Seconds, refuse_timeout_without_hosts

__all__ = ["command"]

DEFAULT_WATCH_SECONDS = 2.0
_MIN_WATCH, _MAX_WATCH = 0.1, 3600.0


def _watch_seconds(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a number of seconds; write e.g. --watch 2",
                                 ctx=ctx, param=param) from None
    if not math.isfinite(seconds) or not _MIN_WATCH <= seconds <= _MAX_WATCH:
        raise click.BadParameter(
            f"{value!r} must be between {_MIN_WATCH:g} and {_MAX_WATCH:g} seconds",
            ctx=ctx, param=param)
    return seconds


@click.command(name="status")
@click.option("--json", "as_json", is_flag=True,
              help="Print the machine-readable document (schema 1, see docs/cli.md).")
@click.option("--watch", metavar="[SECONDS]", is_flag=False, flag_value=str(DEFAULT_WATCH_SECONDS),
              default=None, callback=_watch_seconds,
              help=f"Refresh every SECONDS (default {DEFAULT_WATCH_SECONDS:g}) until Ctrl-C; "
                   "with --json, one document per line.")
@click.option("--no-processes", is_flag=True, help="Leave out the per-process table.")
@click.option("--count", type=click.IntRange(min=1), default=None, hidden=True,
              help="Stop --watch after this many refreshes (for scripts and tests).")
@click.option("--hosts", "hosts", multiple=True, metavar="HOST:PORT,...", is_flag=False,
              flag_value="",
              help="Read these hosts' devicekit serve instead of this machine (commas or "
                   "repeated); alone: from DEVICEKIT_HOSTS or ~/.config/devicekit/hosts.")
@click.option("--timeout", type=Seconds(0.1, 60), default=3.0, show_default=True,
              metavar="SECONDS", help="With --hosts: how long each host has to answer.")
def command(as_json: bool, watch: float | None, no_processes: bool, count: int | None,
            hosts: tuple[str, ...], timeout: float) -> int | None:
    """Show every GPU: memory, utilization, processes, users and devicekit leases.

    Util is the share of time a kernel was running (averaged over the last few seconds), and
    Mem-BW the share of time memory was being read or written: neither is spare capacity.
    With --hosts: one table over several machines, each read from its `devicekit serve`.
    Exit codes: 0 shown (with --hosts: at least one host answered); 1 bad option; 2 NVML or
    driver failure (with --hosts: no host answered).
    """
    refuse_timeout_without_hosts(hosts)
    if hosts:
        if watch is not None:
            raise click.UsageError("--watch does not go with --hosts yet: use "
                                   "'watch devicekit status --hosts' or the lab page of "
                                   "'devicekit serve --peer'")
        return _lab(hosts, timeout, as_json)
    from devicekit.sharing.machine_status import collect_status

    if watch is None:
        report = collect_status()
        if as_json:
            click.echo(json.dumps(_document(report), indent=2))
        else:
            _console().print(_render(report, no_processes))
        return
    previous = signal.signal(signal.SIGTERM, _stop_watching)  # kill/timeout end it like Ctrl-C
    try:
        if as_json:
            _watch_json(watch, count)
        else:
            _watch_table(watch, count, no_processes)
    except KeyboardInterrupt:  # Ctrl-C is how a watch ends: a clean exit, no traceback
        return
    finally:
        signal.signal(signal.SIGTERM, previous)


def _lab(hosts: tuple[str, ...], timeout: float, as_json: bool) -> int:
    from devicekit.serve.lab import PeerReader, lab_document, lab_json
    from devicekit.serve.lab_hosts import lab_hosts

    answers = PeerReader().read(lab_hosts(hosts), timeout)
    if as_json:
        click.echo(lab_json(lab_document(answers)).decode(), nl=False)
    else:
        from devicekit.serve.lab_table import render_lab

        _console().print(render_lab(answers))
    return 0 if any(a.status is not None for a in answers) else 2


def _stop_watching(signum: int, frame: Any) -> None:
    """SIGTERM during a watch: unwind like Ctrl-C, so the live view restores the terminal
    (cursor shown, the prompt on a fresh line) instead of dying mid-frame."""
    raise KeyboardInterrupt


def _console() -> Any:  # a rich Console (rich is imported lazily)
    import sys

    from rich.console import Console

    # piped or captured output gets a fixed, roomy width instead of rich's 80-column default
    tty = sys.stdout.isatty()
    # to a pipe or file: 120 columns for the tables, and text lines (warnings) never folded
    # mid-sentence; a terminal folds long lines itself
    return Console(highlight=False, width=None if tty else 120, soft_wrap=not tty)


def _render(report: Any, no_processes: bool) -> Any:
    from devicekit.sharing.status_table import render_status

    table = render_status(report, all_processes=not no_processes)
    lines = _slurm_lines()
    if not lines:
        return table
    from rich.console import Group
    from rich.text import Text

    return Group(table, *(Text(line) for line in lines))


def _slurm_lines() -> list[str]:
    """Inside a Slurm job (or on a Slurm node): the job, its GPUs, GPUs other jobs hold."""
    from devicekit.hardware.slurm_node import slurm_view

    view = slurm_view()
    return view.lines() if view is not None else []


def _document(report: Any) -> dict[str, Any]:
    """The status document, with ``slurm`` (job id, its GPUs, GPUs taken by other jobs) where
    Slurm has something to say (docs/cli.md)."""
    from devicekit.hardware.slurm_node import slurm_view

    document = report.to_dict()
    view = slurm_view()
    if view is not None:
        document["slurm"] = view.to_dict()
    return document


def _frames(count: int | None) -> Iterator[int]:
    shown = 0
    while count is None or shown < count:
        yield shown
        shown += 1


def _watch_json(seconds: float, count: int | None) -> None:
    from devicekit.sharing.machine_status import collect_status

    for frame in _frames(count):
        if frame:
            time.sleep(seconds)
        click.echo(json.dumps(_document(collect_status())))


def _watch_table(seconds: float, count: int | None, no_processes: bool) -> None:
    from rich.live import Live

    from devicekit.sharing.machine_status import collect_status

    console = _console()
    if not console.is_terminal:  # piped or captured: print each frame after the last
        for frame in _frames(count):
            if frame:
                time.sleep(seconds)
                console.print()
            console.print(_render(collect_status(), no_processes))
        return
    from rich.console import Group
    from rich.text import Text

    hint = Text(f"refreshing every {seconds:g} s; Ctrl-C to quit", style="dim")

    def view() -> Any:
        return Group(_render(collect_status(), no_processes), hint)

    live = Live(view(), console=console, auto_refresh=False, transient=False)
    try:
        # start() inside the try: a Ctrl-C or SIGTERM that lands while it draws the first frame
        # skips a with-statement's __exit__ and would leave the cursor hidden
        live.start(refresh=True)
        for frame in _frames(count):
            if frame:
                time.sleep(seconds)
                live.update(view(), refresh=True)
    finally:
        live.stop()
