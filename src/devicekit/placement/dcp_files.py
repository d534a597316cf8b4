"""Opening the files of a checkpoint directory another user may have written.

A file of a ``torch.distributed.checkpoint`` directory (``.metadata``, ``__0_0.distcp``) is
opened only as a regular file named directly inside the directory: never through a symbolic
link (which could point anywhere, e.g. at ``~/.ssh/id_rsa``), never a FIFO (whose read blocks
forever), a device (``/dev/zero`` never ends) or a socket. The open itself cannot block
(``O_NONBLOCK``) or follow a link (``O_NOFOLLOW``), and the type is checked on the open file
(``fstat``), so swapping the file after the check changes nothing. Each refusal is one line
naming the file. :class:`CheckedFileSystem` is the ``FileSystem`` that DCP's reader opens its
data files through; it also refuses a file shorter than its metadata says.

Usage::

    from devicekit.placement.dcp_files import open_regular, read_bounded

    data = read_bounded(Path("ckpt/.metadata"), 1 << 20, "sharded checkpoint metadata")
    with open_regular(Path("ckpt/__0_0.distcp"), "sharded checkpoint data file") as stream:
        header = stream.read(4)
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint.filesystem import FileSystem

from devicekit.errors import CheckpointError, UnsafeCheckpointError

__all__ = ["open_regular", "read_bounded", "check_regular", "CheckedFileSystem"]

_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
          | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISDIR, "a directory"))


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def _refuse_link(path: Path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{what} {str(path)!r} is a symbolic link; refused (it could point outside the "
        "checkpoint); copy the checkpoint with `cp -rL` to load it")


def check_regular(path: Path, what: str, at_least: int = 0) -> int:
    """The size of ``path``, a regular file (not a link) of ``at_least`` bytes; stats only."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise CheckpointError(f"cannot read {what} {str(path)!r}: {exc.strerror}") from None
    return _checked_size(path, info, what, at_least)


def _checked_size(path: Path, info: os.stat_result, what: str, at_least: int) -> int:
    if stat.S_ISLNK(info.st_mode):
        raise _refuse_link(path, what)
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{what} {str(path)!r} is {_kind(info.st_mode)}, not a regular "
                              "file; refused")
    if info.st_size < at_least:
        raise CheckpointError(f"{what} {str(path)!r} is {info.st_size} bytes, but its metadata "
                              f"reads up to byte {at_least}; the file is truncated or corrupt")
    return info.st_size


@contextmanager
def open_regular(path: Path, what: str, at_least: int = 0) -> Iterator[IO[bytes]]:
    """``path`` opened for reading: a regular file of ``at_least`` bytes, never a link."""
    check_regular(path, what, at_least)  # the clear message; the fstat below is what holds
    try:
        fd = os.open(path, _FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a link (Linux, BSD)
            raise _refuse_link(path, what) from None
        if exc.errno == errno.ENXIO:  # a socket (or a device without its driver)
            raise CheckpointError(f"{what} {str(path)!r} is not a regular file; refused") from None
        raise CheckpointError(f"cannot read {what} {str(path)!r}: {exc.strerror}") from None
    try:
        _checked_size(path, os.fstat(fd), what, at_least)
        stream = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with stream:
        yield stream


def read_bounded(path: Path, limit: int, what: str) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``); never blocks on a FIFO."""
    with open_regular(path, what) as stream:
        size = os.fstat(stream.fileno()).st_size
        if size > limit:
            raise CheckpointError(f"{what} {str(path)!r} is {size} bytes, over the {limit} "
                                  "bytes devicekit reads; refused")
        data = stream.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{what} {str(path)!r} grew past {limit} bytes while read; refused")
    return data


class CheckedFileSystem(FileSystem):
    """DCP's ``FileSystem`` for reading one directory: plain names in it, regular files only.

    ``needed`` maps each data file's name to the bytes its metadata reads from it (set by the
    reader once the metadata is checked); a file that is shorter is refused before it is read.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__()
        self.root = Path(root)
        self.needed: Mapping[str, int] = {}

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        target = Path(path)
        if mode != "rb" or target.parent != self.root or target.name in ("", ".", ".."):
            raise UnsafeCheckpointError(
                f"sharded checkpoint {str(self.root)!r}: refused to open {str(target)!r} with "
                f"mode {mode!r} (only files directly inside it are read)")
        with open_regular(target, "sharded checkpoint data file",
                          self.needed.get(target.name, 0)) as stream:
            yield stream
