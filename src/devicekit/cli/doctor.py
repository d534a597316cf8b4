"""``devicekit doctor``: pass/warn/fail lines for the driver, torch, NCCL, variables and leases.

Each check is printed as soon as it has run; on a terminal the status is coloured and a
status line shows while checks run. Formatting only: the checks live in :mod:`devicekit.sharing.doctor_checks`. Exit code 0 when nothing
failed (warnings allowed), 1 when any check failed. ``--json`` prints
``{"schema": 1, "ok": ..., "summary": {...}, "checks": [{"name", "status", "message"}]}``.

Usage::

    devicekit doctor
    devicekit doctor --json | jq '.checks[] | select(.status != "pass")'
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

import click

from devicekit.cli.phases import PhaseStatus

if TYPE_CHECKING:
    from devicekit.sharing.doctor_checks import Check

__all__ = ["command"]

#: version of the ``devicekit doctor --json`` document
SCHEMA_VERSION = 1

_STYLES = {"pass": "green", "warn": "yellow", "fail": "red", "skip": "bright_black"}
_RUNNING = "running checks (torch and NCCL take a few seconds)"
#: the longest check name (``cuda_visible_devices``): lines align before all checks have run
_NAME_WIDTH = 20


def _line(check: Check) -> str:
    return f"{check.status.upper():4}  {check.name:<{_NAME_WIDTH}}  {check.message}"


def _print_as_they_run(checks: Iterable[Check]) -> list[Check]:
    """Print each check as it completes; on a terminal coloured, under a status line (rich)."""
    done: list[Check] = []
    if not sys.stdout.isatty():  # a log: a status line on stderr for a check that takes a while
        with PhaseStatus("doctor") as status:
            status.phase(_RUNNING)
            for check in checks:
                click.echo(_line(check))
                done.append(check)
                status.phase(f"running checks ({len(done)} done, the next after {check.name})")
        return done
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False, soft_wrap=True)
    with console.status(f"doctor: {_RUNNING}"):
        for check in checks:
            status = f"{check.status.upper():4}"
            rest = escape(_line(check)[len(status):])
            console.print(f"[bold {_STYLES[check.status]}]{status}[/]{rest}")
            done.append(check)
    return done


@click.command(name="doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON (schema 1).")
@click.option("--no-torch", is_flag=True,
              help="Leave out the torch build, torch version and NCCL checks (no torch import).")
def command(as_json: bool, no_torch: bool) -> int:
    """Check driver, torch, NCCL, CUDA variables, the lease directory and launcher variables.

    Each line is PASS, WARN, FAIL or SKIP (not applicable) and says what to do.
    Exit codes: 0 no check failed; 1 at least one failed.
    """
    from devicekit.sharing.doctor_checks import iter_checks, run_checks, summarize

    if as_json:
        with PhaseStatus("doctor") as status:
            status.phase(_RUNNING)
            checks = run_checks(torch=not no_torch)
        summary = summarize(checks)
        click.echo(json.dumps({
            "schema": SCHEMA_VERSION,
            "ok": summary["fail"] == 0,
            "summary": summary,
            "checks": [c.to_dict() for c in checks],
        }, indent=2))
    else:
        checks = _print_as_they_run(iter_checks(torch=not no_torch))
        summary = summarize(checks)
        counts = ", ".join(f"{summary[s]} {s}" for s in ("pass", "warn", "fail", "skip"))
        click.echo(f"\n{counts}")
    ok = summary["fail"] == 0
    return 0 if ok else 1
