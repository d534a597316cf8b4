"""``devicekit queue``: the fair GPU queue: waiting tickets with their reasons, running limits.

Formatting only; the queue is :mod:`devicekit.sharing.queue_state`. Text from ticket files
(commands, filters) is other users' and printed inert (control characters shown as visible escapes, as in ``status``).

Usage::

    devicekit queue                 # waiting tickets in order, reserved GPUs, why each waits
    devicekit queue --json          # the same, versioned ("schema": 1)
    devicekit queue cancel 7        # leave the queue: your own tickets (root: any)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click

__all__ = ["command", "collect"]


def collect() -> Any:
    """The queue view of the configured lease directory (None when it does not exist yet)."""
    from devicekit.hardware import inventory
    from devicekit.hardware.mig import leasable_devices
    from devicekit.sharing.lease_directory import DEFAULT_LEASE_DIR, LEASE_DIR_ENV, lease_dir
    from devicekit.sharing.queue_state import look, read_moment

    raw = os.environ.get(LEASE_DIR_ENV) or DEFAULT_LEASE_DIR
    if not os.path.lexists(Path(raw).expanduser()):  # a look never creates the directory
        return None
    directory = lease_dir()
    leases, tickets = read_moment(directory)  # leases and tickets of one moment
    return look(directory, leasable_devices(inventory.gpus()), leases, tickets=tickets)


@click.group("queue", invoke_without_command=True,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "as_json", is_flag=True, help="Print the queue as JSON (schema 1).")
@click.pass_context
def command(ctx: click.Context, as_json: bool) -> None:
    """Show the fair GPU queue: waiting tickets in order, what each waits for, running limits.

    Every 'run --wait', 'select --wait' and select_gpus(wait=...) takes a ticket; GPUs that
    free up go to the earliest ticket that can use them (reserved for it until it has all it
    needs); a job with --time may use reserved GPUs when it ends before their ticket could
    start. A waiter that is killed leaves the queue at once.
    """
    if ctx.invoked_subcommand is not None:
        return
    view = collect()
    if as_json:
        from devicekit.sharing.queue_state import QUEUE_SCHEMA

        doc = view.to_dict() if view is not None else {
            "schema": QUEUE_SCHEMA, "taken_at": time.time(), "waiting": [], "running": [],
            "policy": None}
        click.echo(json.dumps(doc, indent=2))
        return
    if view is None:
        click.echo("queue: empty (no lease directory yet)")
        return
    for line in render(view.to_dict()):
        click.echo(line)


@command.command("cancel")
@click.argument("ticket")
def cancel(ticket: str) -> None:
    """Cancel waiting TICKET (yours; root: any): its waiter stops waiting."""
    from devicekit.sharing.lease_directory import lease_dir
    from devicekit.sharing.tickets import cancel_ticket

    record = cancel_ticket(lease_dir(), ticket)
    click.echo(f"ticket {record.ticket} of {record.user} (pid {record.pid}) cancelled", err=True)


def _inert(text: object, width: int | None = None, *, keep_end: bool = False) -> str:
    """Printable text, cut to ``width``; ``keep_end``: cut the middle (a reason's end, "(holds 2
    of 4)", says as much as its start)."""
    from devicekit.hardware.printable import printable

    out = printable(text)  # escapes shown as status and select show them
    if width is not None and len(out) > width:
        if keep_end:
            tail = width // 3
            out = out[: width - 3 - tail] + "..." + out[-tail:]
        else:
            out = out[: width - 3] + "..."
    return out


def render(doc: dict[str, Any]) -> list[str]:
    """The text ``devicekit queue`` prints for a ``--json`` document."""
    from devicekit.units import format_duration

    lines: list[str] = []
    policy = doc.get("policy") or {}
    if policy.get("note"):
        lines.append(f"policy: {_inert(policy['note'])}")
    elif policy.get("path"):
        quota = policy.get("max_gpus_per_user")
        limit = policy.get("default_time_limit")
        parts = [f"max {quota} GPU(s) per user" if quota is not None else "",
                 f"default time limit {format_duration(limit)}" if limit else ""]
        lines.append(f"policy: {_inert(policy['path'])}"
                     + (f" ({', '.join(p for p in parts if p)})" if any(parts) else ""))
    # ASKS is a count of GPUs (with the ticket's filters); RESERVED and ON GPUS name GPUs
    rows = [["TICKET", "USER", "PID", "ASKS", "WAITING", "LIMIT", "RESERVED", "REASON", "COMMAND"]]
    for w in doc["waiting"]:
        since = time.strftime("%H:%M", time.localtime(w["since"]))
        waited = format_duration(time.time() - w["since"])
        asked = str(w["gpus_asked"]) + (f" {w['filters']}" if w["filters"] else "")
        rows.append([w["ticket"], w["user"], str(w["pid"]), asked, f"{since} ({waited})",
                     format_duration(w["time_limit"]) if w["time_limit"] else "-",
                     ",".join(g.replace("GPU ", "") for g in w["reserved"]) or "-",
                     w["reason"], w["command"]])
    lines.append(f"waiting: {len(doc['waiting'])}")
    if doc["waiting"]:
        lines.extend(_table(rows))
    running = [["TICKET", "USER", "PID", "ON GPUS", "LIMIT", "ENDS IN", "COMMAND"]]
    for r in doc["running"]:
        running.append([r["ticket"], r["user"], str(r["pid"]),
                        ",".join(g.replace("GPU ", "") for g in r["gpus"]),
                        format_duration(r["time_limit"]) if r["time_limit"] else "-",
                        format_duration(round(r["ends_in"])) if r["ends_in"] is not None else "-",
                        r["command"]])
    lines.append(f"running with a time limit: {len(doc['running'])}")
    if doc["running"]:
        lines.extend(_table(running))
    ignored = doc.get("ignored") or []
    if ignored:  # forged or malformed ticket files: another user's text, printed inert
        lines.append(f"ignored ticket files: {len(ignored)}")
        lines.extend(_table([["USER", "FILE", "WHY"],
                             *([i["user"], i["file"], i["why"]] for i in ignored)]))
    return lines


#: a cell's width at most; a reason's (the REASON column) is wider and cut in the middle
_CELL_WIDTH = 60
_REASON_WIDTH = 120


def _table(rows: list[list[str]]) -> list[str]:
    reason = rows[0].index("REASON") if "REASON" in rows[0] else -1
    rows = [[_inert(c, _REASON_WIDTH, keep_end=True) if i == reason else _inert(c, _CELL_WIDTH)
             for i, c in enumerate(row)] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
