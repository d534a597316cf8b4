"""``devicekit select``: print the ``CUDA_VISIBLE_DEVICES`` value for the best free GPUs.

Only the value goes to stdout, so command substitution works; reasons and progress go to
stderr. The command exits right away, so it cannot hold a lease: another job may take the same
GPUs a moment later. ``devicekit run`` and ``dk.select_gpus`` hold leases.

Usage::

    GPUS=$(devicekit select -n 2 --min-free 20GiB) && CUDA_VISIBLE_DEVICES=$GPUS python train.py
"""

from __future__ import annotations

import os

import click

from devicekit.cli.filters import (
    WAIT_SECONDS,
    Seconds,
    exclude_option,
    max_util_option,
    parse_exclude,
    parse_max_util,
    refuse_timeout_without_hosts,
)
from devicekit.hardware.printable import printable
from devicekit.selection.choose import select_gpus
from devicekit.selection.gpu_request import ORDERS
from devicekit.units import format_size, parse_size

__all__ = ["command"]

_HELP = """Pick free GPUs and print the value for CUDA_VISIBLE_DEVICES.

\b
    GPUS=$(devicekit select -n 2 --min-free 20GiB) && CUDA_VISIBLE_DEVICES=$GPUS python train.py

Only the value is printed on stdout (GPU UUIDs, comma-separated); why the other GPUs were not
chosen, and the wait progress, go to stderr. GPUs leased by devicekit run / dk.select_gpus are
skipped.

Keep the `&&`: when too few GPUs qualify, nothing is printed and the exit code is 3, so the job
never starts. `CUDA_VISIBLE_DEVICES=$(devicekit select) python train.py` would start it anyway,
with every GPU hidden (most scripts then train on the CPU without a word).

This command exits as soon as it prints, so it cannot hold a lease: a job started a moment
later may pick the same GPUs. `devicekit run -- python train.py` both stops when too few GPUs
qualify and holds the lease until the job exits; `dk.select_gpus(...)` does so in Python.

With --format index it prints NVML (nvidia-smi) indices, which are PCI bus order: run the job
with CUDA_DEVICE_ORDER=PCI_BUS_ID, or CUDA's default FASTEST_FIRST order may map them to other
cards. UUIDs (the default) mean the same card under any order.

With --hosts HOST:PORT,... (or --hosts alone: DEVICEKIT_HOSTS, ~/.config/devicekit/hosts) it
reads each host's `devicekit serve` and prints the best host and its GPUs (`gpu3 GPU-..,GPU-..`);
each other host's reason and the command to start the job there go to stderr.

\b
Exit codes: 0 chosen; 1 bad input; 2 NVML or driver failure; 3 too few GPUs (on any host).
"""


@click.command("select", help=_HELP, short_help="Pick free GPUs; print CUDA_VISIBLE_DEVICES.")
@click.option("-n", "--count", default="1", show_default=True, metavar="N",
              help="How many GPUs (or 'all': every eligible one).")
@click.option("--min-free", metavar="SIZE", help="Free memory each GPU needs, with a unit, e.g. 20GiB (GB, G also mean GiB).")
@max_util_option
@exclude_option
@click.option("--order", type=click.Choice(ORDERS), default="free-memory", show_default=True,
              help="Which eligible GPUs come first.")
@click.option("--wait", type=WAIT_SECONDS, metavar="SECONDS",
              help="Wait up to SECONDS for enough GPUs to free up.")
@click.option("--format", "fmt", type=click.Choice(["uuid", "index"]), default="uuid",
              show_default=True, help="Print UUIDs, or indices (then set CUDA_DEVICE_ORDER=PCI_BUS_ID).")
@click.option("--share", is_flag=True,
              help="Accept GPUs shared by --share leases when --min-free fits their budget.")
@click.option("--account-as-free", "users", multiple=True, metavar="USER",
              help="Count USER's processes' GPU memory as free (e.g. your idle notebook).")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing on stderr when GPUs are chosen.")
@click.option("--hosts", "hosts", multiple=True, metavar="HOST:PORT,...", is_flag=False,
              flag_value="",
              help="Choose among these hosts' devicekit serve (commas or repeated); alone: "
                   "from DEVICEKIT_HOSTS or ~/.config/devicekit/hosts.")
@click.option("--timeout", type=Seconds(0.1, 60), default=3.0, show_default=True,
              metavar="SECONDS", help="With --hosts: how long each host has to answer.")
def command(count: str, min_free: str | None, max_util: str | None, exclude: tuple[str, ...],
            order: str, wait: float | None, fmt: str, share: bool, users: tuple[str, ...],
            quiet: bool, hosts: tuple[str, ...], timeout: float) -> int | None:
    n: int | str = count
    if count != "all":
        try:
            n = int(count)
        except ValueError:
            raise click.BadParameter(f"{count!r} is not a whole number or 'all'",
                                     param_hint="'-n'") from None
        if n < 1:  # named as typed, like every other option's error
            raise click.BadParameter(f"{count!r} must be a whole number of GPUs >= 1 or 'all'",
                                     param_hint="'-n'")
    for user in users:
        if not user.strip():
            raise click.BadParameter(f"{user!r} is not a user name",
                                     param_hint="'--account-as-free'")
    if share and min_free is None:
        raise click.UsageError("--share needs --min-free SIZE: the memory budget this job claims")
    # parsed here so that an error names the option the user typed
    min_free_bytes = parse_size(min_free, name="--min-free") if min_free is not None else None
    util = parse_max_util(max_util)
    refuse_timeout_without_hosts(hosts)
    if hosts:
        for flag, given in (("--wait", wait is not None), ("--share", share),
                            ("--exclude", bool(exclude))):
            if given:
                raise click.UsageError(f"{flag} does not go with --hosts (it is one machine's)")
        return _on_hosts(hosts, timeout, n, min_free_bytes, util, order, fmt, users, quiet)
    selection = select_gpus(
        n, min_free_memory=min_free_bytes, max_utilization=util, exclude=parse_exclude(exclude),
        order=order, wait=wait, lease=False, share=share, account_as_free=users,
    )
    click.echo(selection.visible_devices_value(fmt))
    if quiet:
        return
    chosen = ", ".join(f"{g.label} ({format_size(g.memory_free)} free)" for g in selection.gpus)
    click.echo(f"devicekit: chose {printable(chosen)}", err=True)
    for line in selection.rejected:  # may quote other users' commands: made inert
        click.echo(f"devicekit:   {printable(line)}", err=True)
    if fmt == "index" and os.environ.get("CUDA_DEVICE_ORDER", "").upper() != "PCI_BUS_ID":
        click.echo("devicekit: these are PCI bus order indices: run the job with "
                   "CUDA_DEVICE_ORDER=PCI_BUS_ID", err=True)


def _on_hosts(hosts: tuple[str, ...], timeout: float, n: int | str, min_free: int | None,
              util: str | None, order: str, fmt: str, users: tuple[str, ...], quiet: bool) -> int:
    from devicekit.selection.gpu_request import make_request
    from devicekit.serve.lab import PeerReader
    from devicekit.serve.lab_choice import choose_host, start_command
    from devicekit.serve.lab_hosts import lab_hosts

    request = make_request(n, min_free_memory=min_free, max_utilization=util, order=order,
                           account_as_free=users)
    choice = choose_host(PeerReader().read(lab_hosts(hosts), timeout), request)
    best = choice.best
    if best is not None:
        host = best.answer.peer.host if best.answer.peer is not None else best.label
        click.echo(f"{host} {best.value(fmt)}")
        if quiet:
            return 0
        chosen = ", ".join(f"{c.gpu.label} ({format_size(c.available)} free)" for c in best.chosen)
        click.echo(f"devicekit: chose {printable(best.label)}: {printable(chosen)}", err=True)
        click.echo(f"devicekit: start it there: {printable(start_command(best, fmt))}", err=True)
    else:
        asked = "every free GPU" if n == "all" else f"{n} GPU(s)"
        click.echo(f"devicekit: no host has {asked} that qualify now", err=True)
    for verdict in choice.others:  # other machines' text: made inert
        why = verdict.why or "qualifies too, " + (
            f"with less free memory ({format_size(verdict.free_memory)})")
        click.echo(f"devicekit:   {printable(verdict.label)}: {printable(why)}", err=True)
    return 0 if best is not None else 3
