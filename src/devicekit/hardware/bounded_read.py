"""Reading a small file another user may control: bounded, never blocking, never unpickled.

Simulate files, the bench cache and the batch-size cache are JSON that anyone with write access
can replace with ``/dev/zero`` (endless), a FIFO (a read that never returns), a huge file or a
JSON nested 10,000 deep (a ``RecursionError``). :func:`read_json` opens without blocking,
accepts only a regular file of at most ``limit`` bytes, and turns every such case into a
:class:`BadFile` whose message names the file and the problem. A file being rewritten in place
(truncated, then written) can be caught half-written: ``settle`` retries a read that does not
parse while the file was changed in the last moments.

Usage::

    from devicekit.hardware.bounded_read import BadFile, read_json

    try:
        data = read_json(path, limit=1 << 20)
    except BadFile as exc:
        print(exc)        # "'/tmp/x.json' is not a regular file (a FIFO)"
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

__all__ = ["BadFile", "read_bytes", "read_json", "MAX_JSON_BYTES"]

#: the default bound: far above any real simulate file or cache
MAX_JSON_BYTES = 16 * 1024 * 1024
#: how deep JSON may nest (real files: under 6)
MAX_DEPTH = 64
#: a file changed this recently may be mid-rewrite: a failed parse is retried for this long
SETTLE_SECONDS = 2.0


class BadFile(Exception):
    """A file that cannot be read safely; ``str()`` is one line naming the file."""

    def __init__(self, path: Path, problem: str, *, missing: bool = False) -> None:
        super().__init__(f"{str(path)!r} {problem}")
        self.path = path
        self.problem = problem
        self.missing = missing


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def read_bytes(path: str | os.PathLike[str], limit: int = MAX_JSON_BYTES) -> bytes:
    """The content of the regular file ``path``, at most ``limit`` bytes, without blocking."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise BadFile(path, f"cannot be read ({exc.strerror})",
                      missing=isinstance(exc, FileNotFoundError)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
            raise BadFile(path, f"is not a regular file ({kind})")
        if info.st_size > limit:
            raise BadFile(path, f"is {info.st_size} bytes, more than the {limit} read")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise BadFile(path, f"grew past {limit} bytes while being read")
    except OSError as exc:
        raise BadFile(path, f"cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def _depth_ok(text: str) -> bool:
    """Whether brackets nest at most :data:`MAX_DEPTH` deep (strings skipped): checked first,
    so the parser never recurses into a RecursionError."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                return False
        elif char in "]}":
            depth -= 1
    return True


def _parse(path: Path, data: bytes) -> Any:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadFile(path, f"is not valid JSON (not UTF-8 text: {exc.reason} at byte {exc.start})") from None
    if not _depth_ok(text):
        raise BadFile(path, f"is not valid JSON (nested more than {MAX_DEPTH} deep)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadFile(path, f"is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise BadFile(path, "is not valid JSON (nested too deep)") from None


def read_json(path: str | os.PathLike[str], limit: int = MAX_JSON_BYTES, *,
              settle: bool = False) -> Any:
    """Parse the JSON file ``path`` (see module doc); ``settle``: retry a half-rewritten file."""
    path = Path(path)
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        data = read_bytes(path, limit)
        try:
            return _parse(path, data)
        except BadFile:
            if not settle or time.monotonic() >= deadline or not _recently_changed(path):
                raise
        time.sleep(0.05)


def _recently_changed(path: Path) -> bool:
    try:
        return time.time() - os.stat(path).st_mtime < SETTLE_SECONDS
    except OSError:
        return True  # replaced this instant: worth another look
