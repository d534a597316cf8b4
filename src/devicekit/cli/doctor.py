"""``devicekit doctor``: pass/warn/fail lines for the driver, torch, NCCL, variables and leases.

Formatting only: the checks live in :mod:`devicekit.hardware.checks`. Exit code 0 when nothing
failed (warnings allowed), 1 when any check failed. ``--json`` prints
``{"schema": 1, "ok": ..., "summary": {...}, "checks": [{"name", "status", "message"}]}``.

Usage::

    devicekit doctor
    devicekit doctor --json | jq '.checks[] | select(.status != "pass")'
"""

from __future__ import annotations

import json
import sys

import click

__all__ = ["command"]

#: version of the ``devicekit doctor --json`` document
SCHEMA_VERSION = 1

_STYLES = {"pass": "green", "warn": "yellow", "fail": "red", "skip": "bright_black"}


@click.command(name="doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON (schema 1).")
@click.option("--no-torch", is_flag=True,
              help="Leave out the torch build and NCCL checks (no torch import).")
def command(as_json: bool, no_torch: bool) -> int:
    """Check driver, torch, NCCL, CUDA variables, the lease directory and launcher variables.

    Each line is PASS, WARN, FAIL or SKIP (not applicable) and says what to do.
    Exit codes: 0 no check failed; 1 at least one failed.
    """
    from devicekit.hardware.checks import run_checks, summarize

    checks = run_checks(torch=not no_torch)
    summary = summarize(checks)
    ok = summary["fail"] == 0
    if as_json:
        click.echo(json.dumps({
            "schema": SCHEMA_VERSION,
            "ok": ok,
            "summary": summary,
            "checks": [c.to_dict() for c in checks],
        }, indent=2))
    else:
        width = max(len(c.name) for c in checks)
        color = sys.stdout.isatty()
        for check in checks:
            label = click.style(f"{check.status.upper():4}", fg=_STYLES[check.status], bold=True) \
                if color else f"{check.status.upper():4}"
            click.echo(f"{label}  {check.name:<{width}}  {check.message}")
        counts = ", ".join(f"{summary[s]} {s}" for s in ("pass", "warn", "fail", "skip"))
        click.echo(f"\n{counts}")
    return 0 if ok else 1
