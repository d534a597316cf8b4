"""``devicekit serve``: the status page, ``/metrics`` and ``/api/status`` over HTTP.

Parsing options and printing lines only; the server is :class:`devicekit.serve.StatusServer`.
Binds to loopback unless ``--host`` says otherwise, and then says so. A request naming another
``Host`` than the server's own names gets 403 (DNS rebinding); ``--allow-host`` adds a name.
Ctrl-C or SIGTERM stops it cleanly (exit 0). No torch import.

Usage::

    devicekit serve                              # http://127.0.0.1:9400/
    devicekit serve --host 0.0.0.0 --port 9400 --interval 5s --hide-commands
    devicekit serve --host 0.0.0.0 --allow-host gpu1.lab.example   # a name browsers use for it
    devicekit --simulate cluster.json serve --port 0     # any free port; rehearse anywhere
    devicekit serve --peer gpu2:9400 --peer gpu3:9400    # /lab: this host and its peers
"""

from __future__ import annotations

import math
import re
import signal
import threading
from typing import Any

import click

__all__ = ["command", "parse_interval"]

_MIN_INTERVAL, _MAX_INTERVAL = 0.1, 3600.0
_INTERVAL = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|m)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}


def parse_interval(value: str) -> float:
    """``"2s"``, ``"500ms"``, ``"1m"`` or ``"2"`` (seconds) -> seconds; ValueError if not."""
    match = _INTERVAL.match(value)
    if not match:
        raise ValueError(value)
    seconds = float(match.group(1)) * _UNIT[match.group(2)]
    if not math.isfinite(seconds) or not _MIN_INTERVAL <= seconds <= _MAX_INTERVAL:
        raise ValueError(value)
    return seconds


def _interval(ctx: click.Context, param: click.Parameter, value: str) -> float:
    try:
        return parse_interval(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not an interval between {_MIN_INTERVAL:g} s and {_MAX_INTERVAL:g} s; "
            "write e.g. 2s, 500ms or 1m", ctx=ctx, param=param) from None


@click.command(name="serve")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback makes the page reachable from "
                   "other machines.")
@click.option("--port", type=click.IntRange(0, 65535), default=9400, show_default=True,
              help="Port to listen on (0: any free port, printed at start).")
@click.option("--interval", default="2s", show_default=True, callback=_interval,
              help="How often the GPUs are sampled (e.g. 2s, 500ms, 1m).")
@click.option("--hide-commands", is_flag=True,
              help="Leave everyone's command lines out of the page, /metrics and /api/status "
                   "(queue reasons included).")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="Also answer requests whose Host is NAME (repeatable). Always answered: "
                   "localhost and IP addresses; off loopback also this machine's hostname and "
                   "FQDN. Others get 403 (a guard against DNS rebinding).")
@click.option("--peer", "peers", multiple=True, metavar="HOST:PORT",
              help="Another host's devicekit serve to show on the lab page (/lab, /api/lab); "
                   "repeatable. Read every interval, 3 s each at most.")
def command(host: str, port: int, interval: float, hide_commands: bool,
            allow_hosts: tuple[str, ...], peers: tuple[str, ...]) -> None:
    """Serve a live status page (/), Prometheus metrics (/metrics) and the status JSON
    (/api/status). Read-only: nothing a client sends is run or stored.

    Exit codes: 0 stopped by Ctrl-C or SIGTERM; 1 bad option, port in use or bad host;
    2 NVML or driver failure at start.
    """
    from devicekit.serve import StatusServer
    from devicekit.serve.lab_hosts import lab_hosts

    peer_list = []
    if peers:
        try:
            peer_list = lab_hosts(peers, option="--peer", fallback=False)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    server = StatusServer(host, port, interval=interval, hide_commands=hide_commands,
                          allow_hosts=allow_hosts, peers=peer_list)
    server.bind()
    if not server.loopback_only:
        click.echo(f"devicekit serve: listening on {server.address[0]}, reachable from other "
                   "machines: anyone who can connect sees every GPU's users"
                   + (" and command lines" if not hide_commands else "")
                   + " (read-only); --host 127.0.0.1 keeps it to this machine", err=True)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        lab = f", {server.url}lab (lab, {len(peer_list)} peer(s))" if peer_list else ""
        click.echo(f"devicekit serve: {server.url} (page), {server.url}metrics, "
                   f"{server.url}api/status{lab}; sampling every {interval:g} s; Ctrl-C to stop")
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    click.echo("devicekit serve: stopped", err=True)
