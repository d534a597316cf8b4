"""Checks on ``devicekit run``'s request made before any GPU is leased or any process started.

A command that does not exist, or a torchrun option left without its value (``--rdzv-id --``
takes ``--`` as the id), would otherwise lease GPUs, start torchrun and end in torchrun's
63-line traceback or 29-line usage. :func:`check_request` refuses both in one line: a missing
command is :class:`~devicekit.errors.CommandNotFoundError` (exit 127, as a shell), a bad option
value :class:`~devicekit.errors.LaunchError` naming the option and the value.

Usage::

    from devicekit.jobs.preflight import check_request

    check_request(RunRequest(procs=2, command=["nosuchcmd"]))   # CommandNotFoundError
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

from devicekit.errors import CommandNotFoundError, LaunchError
from devicekit.hardware.printable import printable
from devicekit.jobs.request import RunRequest

__all__ = ["check_request", "check_command"]

#: the request's text options passed to torchrun, with the flag a user typed
_TEXT_OPTIONS = (("rdzv_id", "--rdzv-id"), ("rdzv_backend", "--rdzv-backend"),
                 ("rdzv_endpoint", "--rdzv-endpoint"), ("master_addr", "--master-addr"),
                 ("nnodes", "--nnodes"), ("log_dir", "--log-dir"))


def check_request(request: RunRequest, environ: Mapping[str, str] | None = None, *,
                  command: bool = False) -> None:
    """Raise a one-line error for an option value that would fail only after leasing, and with
    ``command=True`` for a command that cannot be started (see module doc)."""
    for attribute, flag in _TEXT_OPTIONS:
        value = getattr(request, attribute)
        if value is None:
            continue
        text = str(value)
        if not text.strip() or text.startswith("-"):
            raise LaunchError(f"{flag} needs a value, got {printable(text)!r}; write e.g. "
                              f"{flag} VALUE before '--' and the command")
    if command and request.command:
        check_command(request.command, environ)


def check_command(command: list[str], environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`CommandNotFoundError` unless ``command[0]`` can be started."""
    program = command[0]
    if program.endswith(".py"):  # run with this Python: the file must exist
        if not os.path.isfile(program):
            raise CommandNotFoundError(f"cannot start {printable(program)!r}: no such file; "
                                       "check the command after '--'")
        return
    environ = os.environ if environ is None else environ
    if "/" in program:
        found = os.path.isfile(program) and os.access(program, os.X_OK)
        why = "not an executable file"
    else:
        found = shutil.which(program, path=environ.get("PATH", os.defpath)) is not None
        why = "command not found on PATH"
    if not found:
        raise CommandNotFoundError(f"cannot start {printable(program)!r}: {why}; check the "
                                   "command after '--'")
