"""The ``devicekit`` command: a thin click group that loads each subcommand lazily.

Each command lives in its own module (``devicekit/cli/<name>.py``) exposing a click command
named ``command``; this module only wires them together and turns errors into one line.
Loading lazily keeps ``devicekit status`` / ``select`` free of torch and quick to start.

Exit codes (all commands): 0 success; 1 bad input; 2 NVML or driver failure; 3 too few GPUs;
``run`` passes its command's exit code through.

Usage::

    devicekit status --json
    GPUS=$(devicekit select -n 2 --min-free 20GiB) && CUDA_VISIBLE_DEVICES=$GPUS python train.py
    devicekit --simulate cluster.json status
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import warnings
from typing import Any, TextIO

import click

from devicekit.errors import DeviceKitError
from devicekit.hardware.printable import printable

__all__ = ["cli", "main", "COMMANDS"]

# command name -> (module, one-line help shown in `devicekit --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "status": ("devicekit.cli.status", "Show every GPU: memory, utilization, processes, leases."),
    "select": ("devicekit.cli.select", "Pick free GPUs; print the value for CUDA_VISIBLE_DEVICES."),
    "run": ("devicekit.cli.run", "Lease GPUs and run a command (or the bundled example) on them."),
    "doctor": ("devicekit.cli.doctor", "Check driver, torch, NCCL, variables and leases."),
    "bench": ("devicekit.cli.bench", "Measure each device (matmul, bandwidths, latency) vs its peak."),
    "estimate": ("devicekit.cli.estimate", "Estimate the memory of one training step before running it."),
    "advise": ("devicekit.cli.advise", "Rank strategies (one GPU, DDP, FSDP, split, offload) for a model."),
    "serve": ("devicekit.cli.serve", "Serve a live status page, /metrics for Prometheus and /api/status."),
    "queue": ("devicekit.cli.queue", "Show the fair GPU queue (waiting tickets, reasons); cancel a ticket."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported only when invoked."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        module = importlib.import_module(entry[0])
        return module.command

    def resolve_command(self, ctx: click.Context,
                        args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        """Like click's, but an unknown name that is close to a command says which one."""
        name = args[0] if args else ""
        if name and not name.startswith("-") and name not in COMMANDS:
            close = difflib.get_close_matches(name, list(COMMANDS), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            ctx.fail(f"no such command '{name}'{hint}")
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--simulate",
    metavar="PATH",
    type=click.Path(dir_okay=False),
    help="Use simulated GPUs from a JSON file (same as DEVICEKIT_SIMULATE=PATH).",
)
@click.version_option(package_name="devicekit", prog_name="devicekit")
def cli(simulate: str | None) -> None:
    """devicekit: pick, lease and use GPUs from the shell."""
    if simulate:
        # set for this process and every child it starts (devicekit run passes it on)
        os.environ["DEVICEKIT_SIMULATE"] = os.path.abspath(simulate)


# click >= 8.2 raises this for a bare 'devicekit'; its message is the whole help text
_NO_ARGS: tuple[type[Exception], ...] = tuple(
    c for c in (getattr(click.exceptions, "NoArgsIsHelpError", None),) if c is not None)


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None,
                  *, _default: Any = warnings.showwarning) -> None:
    """devicekit's own warnings as one ``devicekit: warning: ...`` line; others as Python shows them."""
    if category.__module__.split(".")[0] == "devicekit":
        click.echo(f"devicekit: warning: {printable(message)}", err=True)
    else:
        _default(message, category, filename, lineno, file, line)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI; user errors print one line on stderr, never a traceback."""
    previous = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        _main(argv)
    finally:
        warnings.showwarning = previous


def _main(argv: list[str] | None) -> None:
    try:
        rv = cli.main(args=argv, prog_name="devicekit", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("devicekit: aborted", err=True)
        sys.exit(130)
    except _NO_ARGS as exc:  # bare 'devicekit': the help, as is
        exc.show()
        sys.exit(1)
    except click.ClickException as exc:  # bad flags or arguments: exit 1, one line + hint
        message = exc.format_message()
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        click.echo(f"devicekit: {message}{hint}", err=True)
        sys.exit(1)
    except DeviceKitError as exc:
        click.echo(f"devicekit: {printable(exc.cli_message())}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("devicekit: interrupted", err=True)
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)
