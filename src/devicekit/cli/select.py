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

from devicekit.cli.filters import exclude_option, max_util_option, parse_exclude, parse_max_util
from devicekit.hardware.printable import printable
from devicekit.selection.gpu_request import ORDERS
from devicekit.selection.choose import select_gpus
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

\b
Exit codes: 0 chosen; 1 bad input; 2 NVML or driver failure; 3 too few GPUs.
"""


@click.command("select", help=_HELP, short_help="Pick free GPUs; print CUDA_VISIBLE_DEVICES.")
@click.option("-n", "--count", default="1", show_default=True, metavar="N",
              help="How many GPUs (or 'all': every eligible one).")
@click.option("--min-free", metavar="SIZE", help="Free memory each GPU needs, with a unit, e.g. 20GiB (GB, G also mean GiB).")
@max_util_option
@exclude_option
@click.option("--order", type=click.Choice(ORDERS), default="free-memory", show_default=True,
              help="Which eligible GPUs come first.")
@click.option("--wait", type=click.FloatRange(min=0), metavar="SECONDS",
              help="Wait up to SECONDS for enough GPUs to free up.")
@click.option("--format", "fmt", type=click.Choice(["uuid", "index"]), default="uuid",
              show_default=True, help="Print UUIDs, or indices (then set CUDA_DEVICE_ORDER=PCI_BUS_ID).")
@click.option("--share", is_flag=True,
              help="Accept GPUs shared by --share leases when --min-free fits their budget.")
@click.option("--account-as-free", "users", multiple=True, metavar="USER",
              help="Count USER's processes' GPU memory as free (e.g. your idle notebook).")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing on stderr when GPUs are chosen.")
def command(count: str, min_free: str | None, max_util: str | None, exclude: tuple[str, ...],
            order: str, wait: float | None, fmt: str, share: bool, users: tuple[str, ...],
            quiet: bool) -> None:
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
