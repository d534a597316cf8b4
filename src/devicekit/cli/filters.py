"""The GPU filters ``select`` and ``run`` share: ``--exclude``, ``--max-util``, ``--min-free``,
and their ``--wait SECONDS`` (a finite number: ``nan``, ``inf`` and ``1e999`` are refused by name;
:class:`Seconds` is that type for the other options that take seconds).

One spelling and one parser for both commands, so ``--max-util 0.5`` (a fraction, GPUtil's
habit) is the same one-line error in each, and ``--exclude 1,3`` means the same GPUs.

Usage::

    @click.command()
    @exclude_option
    @max_util_option
    def command(exclude: tuple[str, ...], max_util: str | None) -> None:
        skip = parse_exclude(exclude)          # ['1', '3'] from --exclude 1 --exclude 3
        util = parse_max_util(max_util)        # '50%' from '50' or '50%'; None when not given
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import click

from devicekit.units import parse_percent

__all__ = ["Seconds", "WAIT_SECONDS", "exclude_option", "max_util_option", "parse_exclude", "parse_max_util",
           "refuse_timeout_without_hosts"]

F = TypeVar("F", bound=Callable[..., Any])

exclude_option: Callable[[F], F] = click.option(
    "--exclude", "exclude", multiple=True, metavar="ID",
    help="GPU index or UUID to skip; repeat or comma-separate.")
max_util_option: Callable[[F], F] = click.option(
    "--max-util", "max_util", metavar="PCT",
    help="Highest utilization accepted, in percent (0-100; 50 or 50%, not 0.5).")


class Seconds(click.ParamType):
    """Seconds: a finite number from ``low`` to ``high`` (None: no upper bound), the bad value
    named as typed. click's ``FloatRange`` lets ``nan`` through (every comparison with it is
    false) and names ``1e999`` as ``inf``; a NaN timeout then raised ValueError in a thread join."""

    name = "seconds"

    def __init__(self, low: float = 0.0, high: float | None = None) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = math.nan
        if not math.isfinite(seconds) or seconds < self.low or (self.high is not None and seconds > self.high):
            span = f">= {self.low:g}" if self.high is None else f"from {self.low:g} to {self.high:g}"
            self.fail(f"{value!r} is not a number of seconds {span}", param, ctx)
        return seconds


#: the type of ``select --wait`` and ``run --wait``
WAIT_SECONDS = Seconds(0.0)


def parse_exclude(values: tuple[str, ...] | list[str]) -> list[str]:
    """``("1,3", "GPU-ab")`` -> ``["1", "3", "GPU-ab"]``."""
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def parse_max_util(value: str | None) -> str | None:
    """The percent as ``"<number>%"``, or None; a one-line error naming ``--max-util``.

    Checked here (so a fraction like ``0.5`` is refused before anything is leased), and handed
    on with its ``%`` sign: ``0.5%`` means 0.5 %, which a bare 0.5 would not say to
    ``select_gpus`` (it refuses a bare 0.5 as a fraction).
    """
    if value is None:
        return None
    return f"{parse_percent(value, name='--max-util'):g}%"


def refuse_timeout_without_hosts(hosts: tuple[str, ...]) -> None:
    """``--timeout`` typed without ``--hosts`` would be ignored: say so instead."""
    source = click.get_current_context().get_parameter_source("timeout")
    if not hosts and source is click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("--timeout goes with --hosts (how long each host has to answer)")
