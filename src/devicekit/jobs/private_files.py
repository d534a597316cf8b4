"""Files the supervisor leaves where other users can write (``--log-dir`` on ``/tmp`` or a shared
project directory): readable only by their owner, never through a name someone else chose.

A directory another user can write is a place where a predictable name can be taken first: a
directory planted there, or a symlink to one of your files that a plain ``open(path, "w")`` would
follow and overwrite. So what the supervisor saves there goes into a *new* directory with a
random name and mode 0700 (:func:`private_directory`, ``tempfile.mkdtemp``: never an existing
one), and each file in it is created new (:func:`create_private_file`: ``O_CREAT | O_EXCL |
O_NOFOLLOW``, mode 0600, relative to the directory opened without following a symlink): an
existing file or symlink of that name is an error, never overwritten.

Usage::

    from devicekit.jobs.private_files import create_private_file, private_directory

    directory = private_directory("/shared/logs", "devicekit-hang-")  # .../devicekit-hang-k3v9x2qa
    with create_private_file(directory, "hang-report.txt") as handle:
        handle.write("...")
"""

from __future__ import annotations

import os
import tempfile
from typing import TextIO

__all__ = ["private_directory", "create_private_file"]

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def private_directory(parent: str, prefix: str) -> str:
    """A new directory under ``parent`` with a random name after ``prefix``, mode 0700.

    Never one that exists already (``tempfile.mkdtemp`` retries another name); raises
    ``OSError`` when ``parent`` is missing or not writable.
    """
    return tempfile.mkdtemp(prefix=prefix, dir=parent)


def create_private_file(directory: str, name: str) -> TextIO:
    """``directory/name`` created new for writing (UTF-8 text), mode 0600.

    ``directory`` itself must not be a symlink, and ``name`` must not exist: an existing file,
    directory or symlink of that name raises ``FileExistsError`` and is left as it is.
    """
    if os.sep in name or name in ("", ".", ".."):
        raise ValueError(f"create_private_file: {name!r} is not a plain file name")
    dir_fd = os.open(directory, _DIRECTORY_FLAGS)
    try:
        fd = os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    return os.fdopen(fd, "w", encoding="utf-8")
