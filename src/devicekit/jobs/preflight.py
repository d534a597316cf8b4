"""Checks on ``devicekit run``'s request made before any GPU is leased or any process started.

A command that does not exist, or a torchrun option left without its value (``--rdzv-id --``
takes ``--`` as the id), would otherwise lease GPUs, start torchrun and end in torchrun's
63-line traceback or 29-line usage. :func:`check_request` refuses both in one line: a missing
command is :class:`~devicekit.errors.CommandNotFoundError` (exit 127, as a shell), a bad option
value :class:`~devicekit.errors.LaunchError` naming the option and the value.

A command that starts ``python`` (``python3``, ``python3.11``) runs whichever interpreter that
name finds on PATH, which is not devicekit's own when its virtual environment is not activated:
the script then fails on ``import torch``. :func:`interpreter_warning` says so in one line (the
user asked for ``python``, so that is still what runs); a ``.py`` file given alone runs with
devicekit's interpreter.

Usage::

    from devicekit.jobs.preflight import check_request, interpreter_warning

    check_request(RunRequest(procs=2, command=["nosuchcmd"]))   # CommandNotFoundError
    interpreter_warning(["python", "train.py"])   # "warning: 'python' here is /usr/bin/python3..."
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence

from devicekit.errors import CommandNotFoundError, LaunchError
from devicekit.hardware.printable import printable
from devicekit.jobs.request import RunRequest

__all__ = ["check_request", "check_command", "interpreter_warning"]

#: the request's text options passed to torchrun, with the flag a user typed
_TEXT_OPTIONS = (("rdzv_id", "--rdzv-id"), ("rdzv_backend", "--rdzv-backend"),
                 ("rdzv_endpoint", "--rdzv-endpoint"), ("master_addr", "--master-addr"),
                 ("nnodes", "--nnodes"), ("log_dir", "--log-dir"))
#: a command word that names a Python interpreter: python, python3, python3.11
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")


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
    advice = "check the command after '--'"
    if "/" in program:
        found = os.path.isfile(program) and os.access(program, os.X_OK)
        why = "not an executable file"
    else:
        found = shutil.which(program, path=environ.get("PATH", os.defpath)) is not None
        why = "command not found on PATH"
        if _PYTHON.fullmatch(program):
            advice = _fix(command)  # devicekit's own Python is at hand
    if not found:
        raise CommandNotFoundError(f"cannot start {printable(program)!r}: {why}; {advice}")


def interpreter_warning(command: Sequence[str], environ: Mapping[str, str] | None = None) -> str | None:
    """One line when ``command[0]`` is ``python``/``python3``/``pythonX.Y`` and that name on
    ``environ``'s PATH (the child's) is not the interpreter devicekit runs in; else None."""
    if not command or not _PYTHON.fullmatch(command[0]):
        return None
    name = command[0]
    environ = os.environ if environ is None else environ
    found = shutil.which(name, path=environ.get("PATH", os.defpath))
    if found is not None and _identity(found) == _identity(sys.executable):
        return None
    torch = " (which has torch)" if importlib.util.find_spec("torch") is not None else ""
    if found is None:
        here = f"'{name}' is not on PATH at all; devicekit's Python is {sys.executable}{torch}"
    else:
        here = f"'{name}' here is {found}, not devicekit's {sys.executable}{torch}"
    return printable(f"warning: {here}; {_fix(command)}")


def _fix(command: Sequence[str]) -> str:
    """What to do instead: activate devicekit's environment, or let devicekit pick the interpreter."""
    bindir = os.path.dirname(sys.executable)
    activate = os.path.join(bindir, "activate")
    if sys.prefix != sys.base_prefix and os.path.isfile(activate):
        relative = os.path.relpath(activate)
        first = f"run 'source {activate if relative.startswith('..') else relative}' first"
    else:
        first = f"put {bindir} first on PATH"
    rest = list(command[1:])
    if rest and rest[0].endswith(".py"):
        return (f"{first}, or give the script alone: devicekit run -- {shlex.quote(rest[0])}"
                + (" ..." if len(rest) > 1 else ""))
    return f"{first}, or name the interpreter: devicekit run -- {shlex.quote(sys.executable)} ..."


def _identity(path: str) -> tuple[str, str | None]:
    """What tells two interpreters apart: the real file, and the virtual environment it starts.

    A venv's ``python`` is a symlink to the base interpreter, so the real file alone cannot tell
    ``.venv/bin/python`` (with torch) from the base ``python3`` (without). Python finds its venv
    by ``pyvenv.cfg`` beside the path it was started by or one folder up, without following
    symlinks first (a link elsewhere to ``.venv/bin/python`` starts the base interpreter).
    """
    folder = os.path.dirname(os.path.abspath(path))
    venv = next((d for d in (folder, os.path.dirname(folder))
                 if os.path.isfile(os.path.join(d, "pyvenv.cfg"))), None)
    return os.path.realpath(path), venv
