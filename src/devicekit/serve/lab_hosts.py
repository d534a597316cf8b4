"""Which hosts the lab view reads: ``--hosts``, else ``DEVICEKIT_HOSTS``, else the hosts file.

``--hosts a:9400,b:9400`` (commas or spaces; repeatable) names them; ``--hosts`` alone takes them
from ``DEVICEKIT_HOSTS`` (same spelling), else from ``$XDG_CONFIG_HOME/devicekit/hosts``
(default ``~/.config/devicekit/hosts``): one host per line, ``#`` starts a comment. A host is
``HOST``, ``HOST:PORT``, ``[V6]:PORT`` or ``http://HOST:PORT/`` (port 9400 when left out).
A bad entry is one line naming it (and the file and line it came from); the file is read
bounded, like every file devicekit reads.

Usage::

    from devicekit.serve.lab_hosts import lab_hosts

    peers = lab_hosts(["gpu1:9400,gpu2"])      # [PeerAddress(gpu1, 9400), PeerAddress(gpu2, 9400)]
    peers = lab_hosts([])                      # from DEVICEKIT_HOSTS or the hosts file
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from devicekit.errors import InvalidValueError
from devicekit.hardware.bounded_read import BadFile, read_bytes
from devicekit.serve.inert import inert_text
from devicekit.serve.lab import MAX_PEERS
from devicekit.serve.peer_fetch import PeerAddress

__all__ = ["lab_hosts", "hosts_file", "HOSTS_ENV"]

HOSTS_ENV = "DEVICEKIT_HOSTS"
_SPLIT = re.compile(r"[\s,]+")
_FILE_LIMIT = 64 * 1024


def hosts_file(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CONFIG_HOME/devicekit/hosts``, or ``~/.config/devicekit/hosts``."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or ""
    root = Path(base) if os.path.isabs(base) else Path.home() / ".config"
    return root / "devicekit" / "hosts"


def _parse(words: Sequence[str], where: str) -> list[PeerAddress]:
    peers = []
    for word in words:
        try:
            peers.append(PeerAddress.parse(word))
        except InvalidValueError as exc:
            raise InvalidValueError(f"{where}: {exc}") from None
    return peers


def lab_hosts(given: Sequence[str], environ: Mapping[str, str] | None = None, *,
              option: str = "--hosts", fallback: bool = True) -> list[PeerAddress]:
    """The hosts to read, in order, each once (see the module doc). ``option``: the flag the
    hosts came from, for errors; ``fallback=False``: only ``given`` (``serve --peer``)."""
    environ = os.environ if environ is None else environ
    words = [w for value in given for w in _SPLIT.split(value) if w]
    if words or not fallback:
        if not words:
            raise InvalidValueError(f"{option} needs HOST:PORT, e.g. {option} gpu2:9400")
        peers = _parse(words, option)
    elif environ.get(HOSTS_ENV, "").strip():
        peers = _parse([w for w in _SPLIT.split(environ[HOSTS_ENV]) if w], HOSTS_ENV)
    else:
        peers = _from_file(hosts_file(environ))
    unique = list(dict.fromkeys(peers))
    if len(unique) > MAX_PEERS:
        raise InvalidValueError(f"{len(unique)} hosts: the lab view reads at most {MAX_PEERS}")
    return unique


def _from_file(path: Path) -> list[PeerAddress]:
    try:
        data = read_bytes(path, _FILE_LIMIT)
    except BadFile as exc:
        if exc.missing:
            raise InvalidValueError(
                f"no hosts given: use --hosts HOST:PORT,HOST:PORT, set {HOSTS_ENV}, or list them "
                f"in {path} (one per line)") from None
        raise InvalidValueError(f"hosts file {inert_text(exc, 200)}") from None
    peers = []
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        words = [w for w in _SPLIT.split(line.split("#", 1)[0]) if w]
        peers += _parse(words, f"{path} line {number}")
    if not peers:
        raise InvalidValueError(f"hosts file {path} lists no hosts: one HOST:PORT per line")
    return peers
