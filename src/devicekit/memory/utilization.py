"""``dk.show_utilization()``: the machine's GPU table, one line per GPU, or this process's memory.

The GPUtil call the seeds copy (``GPUtil.showUtilization()``), done right: the table is
:func:`devicekit.sharing.status_table.render_status` (no torch); ``this_process=True`` adds torch's
allocator figures (:mod:`devicekit.memory.usage_line`), which is why this lives in ``memory``
and not in ``hardware`` (hardware never reaches up a wing).

Usage::

    import devicekit as dk

    dk.show_utilization()                                   # the table
    dk.show_utilization(compact=True)                       # one line per GPU
    dk.show_utilization(this_process=True, label="step 1")  # this process's memory
"""

from __future__ import annotations

from typing import IO

__all__ = ["show_utilization"]


def show_utilization(*, file: IO[str] | None = None, all_processes: bool = True,
                     compact: bool = False, this_process: bool = False,
                     label: str | None = None) -> None:
    """Print the table for this machine now (to ``file``, default stdout).

    ``compact=True``: one line per GPU instead of the table (no torch import).
    ``this_process=True``: one line for this process's devices (torch's allocated, reserved and
    peak, plus the GPU's used / total from NVML), cheap enough to call every step.
    ``label`` (compact forms only) goes in front of each line, e.g. ``label=f"step {step}"``.
    """
    import sys

    if compact or this_process:
        if this_process:
            from devicekit.memory.usage_line import process_line

            lines = [process_line(label)]
        else:
            from devicekit.hardware.compact import gpu_lines

            lines = gpu_lines(label)
        out = file if file is not None else sys.stdout
        out.write("".join(f"{line}\n" for line in lines))
        out.flush()
        return
    if label is not None:
        from devicekit.errors import InvalidValueError

        raise InvalidValueError("label= goes with compact=True or this_process=True, not the table")
    from rich.console import Console

    from devicekit.sharing.machine_status import collect_status
    from devicekit.sharing.status_table import console_width, render_status

    report = collect_status()
    width = console_width(file)
    console = Console(file=file, width=width, highlight=False, soft_wrap=width is not None)
    console.print(render_status(report, all_processes=all_processes))
