"""The lab page (``/lab``) and its live part (``/lab/fragment``): every host's GPUs and jobs.

Rendered from the lab document (:func:`devicekit.serve.lab.lab_document`): one card per host,
this server first, each with how old its answer is and why the latest read failed, then one
row per GPU (utilization, memory, who leases it with which job and since when, whose processes
run on it) and the host's waiting jobs. Everything shown from a host passes through
:func:`devicekit.serve.inert.inert_html`; the page is the status page's shell (same stylesheet,
same script, which fetches ``/lab/fragment`` every interval and swaps it in), so the server's
Content-Security-Policy covers it unchanged: no inline script, no external asset.

Usage::

    from devicekit.serve.lab_page import render_lab_page

    html = render_lab_page(lab_doc, interval=2.0, title="lab1")
"""

from __future__ import annotations

import time
from typing import Any

from devicekit.serve.inert import inert_html as esc
from devicekit.serve.people import gpus_asked, queue_tickets
from devicekit.serve.prometheus import free_devices
from devicekit.serve.time_text import clock, iso
from devicekit.sharing.status_table import gpu_cells, gpu_state
from devicekit.units import format_duration

__all__ = ["render_lab_page", "render_lab_fragment"]

_SHELL = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>The lab from {host}: devicekit</title>
<link rel="stylesheet" href="/static/page.css">
<script src="/static/page.js" defer></script>
</head>
<body>
<header><h1>The lab: {count} host(s)</h1><span id="state" class="state">live</span></header>
<main id="live" data-interval-ms="{interval_ms}" data-fragment="/lab/fragment">
{fragment}
</main>
<footer>devicekit {version} &middot; read-only &middot; <a href="/">this host</a> &middot;
<a href="/api/lab">/api/lab</a></footer>
</body>
</html>
"""
#: warnings shown per host (the host's own page has them all)
_WARNINGS_SHOWN = 3


def render_lab_page(lab: dict[str, Any], *, interval: float, fragment: str | None = None,
                    title: str = "", version: str = "") -> str:
    """The whole lab page around :func:`render_lab_fragment` (or the ``fragment`` given)."""
    if fragment is None:
        fragment = render_lab_fragment(lab)
    return _SHELL.format(host=esc(title), count=len(lab.get("hosts", [])),
                         interval_ms=int(interval * 1000), fragment=fragment,
                         version=esc(version))


def render_lab_fragment(lab: dict[str, Any]) -> str:
    """The live part: a summary line, then one card per host."""
    now = float(lab.get("taken_at") or time.time())
    hosts = lab.get("hosts", [])
    answered = sum(1 for h in hosts if h.get("status") is not None)
    free = sum(free_devices(h["status"]) for h in hosts if h.get("status") is not None)
    parts = [f'<p class="summary" data-taken-at="{now:.3f}">{answered} of {len(hosts)} host(s) '
             f"answered &middot; {free} GPU(s) free &middot; taken "
             f'<time datetime="{iso(now)}">{clock(now)}</time></p>', '<div class="hosts">']
    parts.extend(_host(h, now) for h in hosts)
    parts.append("</div>")
    return "\n".join(parts)


def _host(host: dict[str, Any], now: float) -> str:
    status = host.get("status")
    label = esc(host.get("host"), 100)
    name = esc(((status or {}).get("host") or {}).get("hostname"), 100)
    badge = '<span class="badge">this server</span>' if host.get("local") else ""
    state = "down" if status is None else "stale" if host.get("error") else "up"
    parts = [f'<section class="host {state}" data-host="{label}">',
             f"<h2>{label}" + (f' <span class="name">{name}</span>' if name and name != label
                               else "") + f"{badge}</h2>"]
    age = host.get("age")
    if isinstance(age, int | float) and not isinstance(age, bool):
        parts.append(f'<p class="facts">answer {format_duration(age)} old</p>')
    if host.get("error"):
        what = "no answer" if status is None else "latest read failed, showing the last answer"
        parts.append(f'<p class="error" role="alert">{what}: {esc(host["error"])}</p>')
    if status is not None:
        parts.append(_gpu_table(status, now))
        parts.append(_queue(status, now))
        warnings = status.get("warnings") or []
        parts.extend(f'<p class="warning">{esc(w)}</p>' for w in warnings[:_WARNINGS_SHOWN])
        if len(warnings) > _WARNINGS_SHOWN:
            parts.append(f'<p class="warning">{len(warnings) - _WARNINGS_SHOWN} more warning(s) '
                         "on the host's own page</p>")
    parts.append("</section>")
    return "\n".join(p for p in parts if p)


def _gpu_table(status: dict[str, Any], now: float) -> str:
    gpus = [g for g in status.get("gpus") or () if isinstance(g, dict)]
    if not gpus:
        return '<p class="empty">No GPUs.</p>'
    rows = []
    for gpu in gpus:
        cells, state = gpu_cells(gpu), gpu_state(gpu)
        leases = [r for r in gpu.get("leases") or () if isinstance(r, dict)]
        rows.append(
            f'<tr class="{state.replace(" ", "-")}" data-uuid="{esc(gpu.get("uuid"), 130)}">'
            + "".join(f"<td>{esc(cells[key][0], 100)}</td>" for key in ("gpu", "name", "util",
                                                                          "memory"))
            + f"<td>{_leases(leases, now) if leases else esc(state)}</td>"
            f"<td>{esc(cells['users'][0])}</td></tr>")
    return ('<table class="lab-gpus"><thead><tr><th>GPU</th><th>Name</th><th>Util</th>'
            "<th>Memory</th><th>Lease and job</th><th>Processes of</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def _leases(leases: list[dict[str, Any]], now: float) -> str:
    items = []
    for lease in leases:
        bits = [f'<b class="user">{esc(lease.get("user"), 100)}</b>']
        if lease.get("job"):
            bits.append(f'job <b class="job">{esc(lease.get("job"), 64)}</b>')
        since = lease.get("since")
        if isinstance(since, int | float) and not isinstance(since, bool):
            bits.append(f'since <time datetime="{iso(float(since))}">{clock(float(since))}'
                        f"</time> ({format_duration(now - float(since))})")
        idle = lease.get("idle_since")
        if isinstance(idle, int | float) and not isinstance(idle, bool):
            bits.append(f'<span class="idle">idle {format_duration(now - float(idle))}</span>')
        items.append(" ".join(bits))
    return "<br>".join(items)


def _queue(status: dict[str, Any], now: float) -> str:
    tickets = queue_tickets(status)
    if not tickets:
        return ""
    items = []
    for ticket in tickets:
        since = ticket.get("since")
        waited = format_duration(now - float(since)) if isinstance(since, int | float) and \
            not isinstance(since, bool) else "?"
        items.append(f"<li>{esc(ticket.get('user'), 100)}: {gpus_asked(ticket)} GPU(s), "
                     f"waiting {waited}: {esc(ticket.get('reason') or '')}</li>")
    return f'<p class="facts">{len(tickets)} job(s) waiting</p><ul class="waiting">' + \
        "".join(items) + "</ul>"
