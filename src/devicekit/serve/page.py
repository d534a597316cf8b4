"""The status page (``/``) and its live part (``/fragment``), rendered from a status document.

The page is one HTML shell with the live part inside, so it reads without JavaScript; a small
script (``/static/page.js``) fetches ``/fragment`` every interval and swaps it in, so it
refreshes without a full reload. Every text the page shows that someone else controls goes
through :func:`devicekit.serve.inert.inert_html`; the server also sends a Content-Security-
Policy that allows only its own script and style, so no injected markup could run. No external
assets: it works offline. The layout is one column on a phone and a grid of cards on a screen.

Usage::

    from devicekit.sharing.machine_status import collect_status
    from devicekit.serve.page import render_page

    html = render_page(collect_status().to_dict(), interval=2.0)
"""

from __future__ import annotations

import time
from typing import Any

from devicekit.serve.inert import inert_html as esc
from devicekit.serve.people import OTHER, gpus_asked, queue_tickets, user_totals
from devicekit.serve.time_text import clock as _clock
from devicekit.serve.time_text import iso as _iso
from devicekit.sharing.status_table import gpu_state
from devicekit.units import format_duration, format_size

__all__ = ["render_page", "render_fragment"]

_SHELL = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>GPUs on {host}: devicekit</title>
<link rel="stylesheet" href="/static/page.css">
<script src="/static/page.js" defer></script>
</head>
<body>
<header><h1>GPUs on {host}</h1><span id="state" class="state">live</span></header>
<main id="live" data-interval-ms="{interval_ms}">
{fragment}
</main>
<footer>devicekit {version} &middot; read-only &middot;
<a href="/lab">the lab</a> &middot; <a href="/metrics">/metrics</a> &middot;
<a href="/api/status">/api/status</a></footer>
</body>
</html>
"""


def render_page(doc: dict[str, Any], *, interval: float, error: str | None = None,
                hide_commands: bool = False, fragment: str | None = None) -> str:
    """The whole page: the shell around :func:`render_fragment` (or the ``fragment`` given,
    already rendered from ``doc``)."""
    if fragment is None:
        fragment = render_fragment(doc, error=error, hide_commands=hide_commands)
    return _SHELL.format(host=esc(doc.get("host", {}).get("hostname", "")),
                         interval_ms=int(interval * 1000), fragment=fragment,
                         version=esc(doc.get("devicekit_version", "")))


def render_fragment(doc: dict[str, Any], *, error: str | None = None,
                    hide_commands: bool = False) -> str:
    """The live part: summary, per-user totals, one card per GPU, the queue, stray leases."""
    now = float(doc.get("taken_at") or time.time())
    parts = [_summary(doc, now)]
    if error:
        parts.append(f'<p class="error" role="alert">latest sample failed: {esc(error)}; '
                     "showing the last good one</p>")
    parts.extend(f'<p class="warning">{esc(w)}</p>' for w in doc.get("warnings", []))
    parts.append(_users(doc))
    parts.append('<div class="cards">')
    parts.extend(_gpu_card(gpu, now, hide_commands) for gpu in doc.get("gpus", []))
    parts.append("</div>")
    if not doc.get("gpus"):
        parts.append('<p class="empty">No GPUs on this machine.</p>')
    parts.append(_queue(doc, now))
    others = doc.get("other_leases", [])
    if others:
        parts.append("<h2>Leases on devices not present</h2>")
        parts.append(_lease_list(others, now, hide_commands))
    return "\n".join(p for p in parts if p)


def _summary(doc: dict[str, Any], now: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    driver = doc.get("driver_version")
    bits = [f"backend {esc(doc.get('backend'))}", f"{len(doc.get('gpus', []))} GPU(s)"]
    if driver:
        bits.append(f"driver {esc(driver)}")
    bits.append(f'taken <time datetime="{_iso(now)}">{stamp}</time>')
    return f'<p class="summary" data-taken-at="{now:.3f}">{" &middot; ".join(bits)}</p>'


def _users(doc: dict[str, Any]) -> str:
    rows = user_totals(doc)
    if not rows:
        return '<p class="empty">Nobody uses a GPU right now.</p>'
    waiting = any(r.waiting_jobs for r in rows)
    head = "<tr><th>User</th><th>Leased</th><th>Processes</th><th>GPU memory</th>"
    head += "<th>Waiting</th></tr>" if waiting else "</tr>"
    body = []
    for r in rows:
        cls = ' class="other"' if r.user == OTHER else ""
        cells = (f"<td>{esc(r.user)}</td><td>{r.leased_devices}</td><td>{r.processes}</td>"
                 f"<td>{format_size(r.gpu_memory)}</td>")
        if waiting:
            cells += f"<td>{r.waiting_jobs} job(s), {r.waiting_gpus} GPU(s)</td>"
        body.append(f"<tr{cls}>{cells}</tr>")
    return ('<h2>Who uses what</h2><table class="users"><thead>' + head + "</thead><tbody>"
            + "".join(body) + "</tbody></table>")


def _percent(value: Any) -> str:
    return "n/a" if value is None else f"{float(value):.0f}%"


def _meter(label: str, share: float | None, text: str) -> str:
    width = 0.0 if share is None else min(max(share, 0.0), 1.0) * 100
    level = "high" if width >= 90 else "mid" if width >= 50 else "low"
    return (f'<div class="meter"><span class="label">{label}</span>'
            f'<span class="bar"><span class="fill {level}" style="width:{width:.0f}%"></span></span>'
            f'<span class="value">{text}</span></div>')


def _gpu_card(gpu: dict[str, Any], now: float, hide_commands: bool) -> str:
    total = int(gpu.get("memory_total") or 0)
    used = int(gpu.get("memory_used") or 0)
    util = gpu.get("utilization")
    membw = gpu.get("memory_bandwidth_utilization")
    facts = []
    if gpu.get("temperature") is not None:
        facts.append(f"{gpu['temperature']} &deg;C")
    if gpu.get("power_draw") is not None:
        limit = gpu.get("power_limit")
        facts.append(f"{gpu['power_draw']:.0f}" + (f" / {limit:.0f}" if limit else "") + " W")
    if membw is not None:
        facts.append(f"mem-bw {_percent(membw)}")
    if gpu.get("mig_enabled") and not gpu.get("mig_devices"):
        facts.append("MIG mode, no instances")
    leases = gpu.get("leases", [])
    state = gpu_state(gpu)
    parts = [
        f'<section class="gpu {state.replace(" ", "-")}" data-index="{esc(gpu.get("index"))}" '
        f'data-uuid="{esc(gpu.get("uuid"))}">',
        f'<h3>GPU {esc(gpu.get("index"))} <span class="name">{esc(gpu.get("name"))}</span>'
        f'<span class="badge">{state}</span></h3>',
        f'<p class="uuid">{esc(gpu.get("uuid"))}</p>',
        _meter("Util", None if util is None else float(util) / 100, _percent(util)),
        _meter("Memory", used / total if total else None,
               f"{format_size(used)} / {format_size(total)}"),
    ]
    if facts:
        parts.append(f'<p class="facts">{" &middot; ".join(facts)}</p>')
    migs = gpu.get("mig_devices", [])
    if migs:
        parts.append(_mig_table(migs))
    if leases:
        parts.append(_lease_list(leases, now, hide_commands))
    procs = gpu.get("processes", [])
    if procs:
        parts.append(_process_table(procs, hide_commands))
    parts.append("</section>")
    return "\n".join(parts)


def _mig_table(migs: list[dict[str, Any]]) -> str:
    rows = []
    for mig in migs:
        holders = ", ".join(esc(lease.get("user")) for lease in mig.get("leases", [])) or "-"
        rows.append(f'<tr data-uuid="{esc(mig.get("uuid"))}"><td>MIG {esc(mig.get("index"))}</td>'
                    f"<td>{esc(mig.get('name'))}</td>"
                    f"<td>{format_size(int(mig.get('memory_used') or 0))} / "
                    f"{format_size(int(mig.get('memory_total') or 0))}</td><td>{holders}</td></tr>")
    return ('<table class="mig"><thead><tr><th>MIG</th><th>Profile</th><th>Memory</th>'
            "<th>Lease</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def _lease_list(leases: list[dict[str, Any]], now: float, hide_commands: bool) -> str:
    items = []
    for lease in leases:
        since = float(lease.get("since") or now)
        verb = ("held through its lock by" if lease.get("kind") == "lock"
                else "shared by" if lease.get("share") else "leased by")
        bits = [f'{verb} <b class="user">{esc(lease.get("user"))}</b>',
                f"pid {esc(lease.get('pid'))}"]
        if lease.get("job"):
            bits.append(f'job <b class="job">{esc(lease.get("job"), 64)}</b>')
        if lease.get("host"):
            bits.append(f"on {esc(lease.get('host'))}")
        if not hide_commands and lease.get("command"):
            bits.append(f'<code>{esc(lease.get("command"))}</code>')
        if lease.get("memory"):
            bits.append(f"{format_size(int(lease['memory']))} asked")
        bits.append(f'since <time datetime="{_iso(since)}">{_clock(since)}</time> '
                    f"({format_duration(now - since)})")
        idle = lease.get("idle_since")
        if isinstance(idle, int | float) and not isinstance(idle, bool):
            bits.append(f'<span class="idle">GPU idle for {format_duration(now - float(idle))}</span>')
        limit = lease.get("time_limit")
        if isinstance(limit, int | float) and not isinstance(limit, bool):
            bits.append(f"time limit {format_duration(float(limit))}")
        items.append(f'<li class="lease">{", ".join(bits)}</li>')
    return '<ul class="leases">' + "".join(items) + "</ul>"


def _process_table(procs: list[dict[str, Any]], hide_commands: bool) -> str:
    rows = []
    for proc in procs:
        command = "<i>hidden</i>" if hide_commands else f"<code>{esc(proc.get('command'))}</code>"
        memory = proc.get("memory")
        rows.append(f"<tr><td>{esc(proc.get('user') or '?')}</td><td>{esc(proc.get('pid'))}</td>"
                    f"<td>{format_size(int(memory)) if memory is not None else '?'}</td>"
                    f'<td class="command">{command}</td></tr>')
    return ('<table class="procs"><thead><tr><th>User</th><th>PID</th><th>Memory</th>'
            "<th>Command</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def _queue(doc: dict[str, Any], now: float) -> str:
    tickets = queue_tickets(doc)
    if "queue" not in doc:
        return ""
    if not tickets:
        return '<h2>Queue</h2><p class="empty">Nobody waits.</p>'
    rows = []
    for ticket in tickets:
        since = ticket.get("since")
        waited = (f'<time datetime="{_iso(float(since))}">{_clock(float(since))}</time> '
                  f"({format_duration(now - float(since))})"
                  if isinstance(since, int | float) and not isinstance(since, bool) else "?")
        state = "reserved" if ticket.get("reserved") else "waiting"  # GPUs kept free for it
        rows.append(f"<tr><td>{esc(ticket.get('user'))}</td><td>{gpus_asked(ticket)}</td>"
                    f"<td>{state}</td><td>{waited}</td>"
                    f"<td>{esc(ticket.get('reason', ''))}</td></tr>")
    return ('<h2>Queue</h2><table class="queue"><thead><tr><th>User</th><th>GPUs</th>'
            "<th>State</th><th>Since</th><th>Why</th></tr></thead><tbody>" + "".join(rows)
            + "</tbody></table>")
