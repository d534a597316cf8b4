"""Which ``Host`` (and ``Origin``) a request to ``devicekit serve`` may name: no DNS rebinding.

A web page a user opens can point a name it owns (``evil.example``) at 127.0.0.1 after the page
has loaded; the browser then treats ``http://evil.example:9400/api/status`` as the page's own
and lets its script read every user's command lines. The browser still sends ``Host:
evil.example:9400``, so the server answers only the names it is known by, on any port (an ssh
tunnel changes the port, never the name):

- always: ``localhost`` and any IP address literal (``127.0.0.1``, ``[::1]``, ``10.1.2.3``): a
  literal is no DNS name, so there is nothing to rebind, and Prometheus scrapes by IP:port work;
- a bind to anything but loopback: also the machine's hostname and FQDN;
- each ``--allow-host NAME``;
- no ``Host`` at all (HTTP/1.0): accepted.

An ``Origin`` header, where a browser sends one, must name an accepted host too (``null``
never does). Everything else gets 403 with one line naming the refused host, inert.

Usage::

    from devicekit.serve.hosts import HostPolicy

    policy = HostPolicy.for_bind("127.0.0.1", allow=("gpu1.lab.example",))
    policy.refusal("evil.example:9400", None)   # the one-line 403 body (str)
    policy.refusal("localhost:9400", None)      # None: answer it
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from devicekit.errors import ServeError
from devicekit.serve.inert import inert_text

__all__ = ["HostPolicy", "check_host_name", "host_name"]

_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
                   r"(?:\.[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?)*$")
_ALWAYS = frozenset({"localhost"})


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return False
    return True


def host_name(value: str) -> str | None:
    """The name part of a ``Host`` value (``name``, ``name:port``, ``[v6]:port``), lowercased,
    without a trailing dot; an IPv6 literal without its brackets. None when malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1:]
        if not _is_ip(name) or ":" not in name:
            return None
    elif value.count(":") > 1:  # a bare IPv6 literal (no port possible)
        name, rest = value, ""
        if not _is_ip(name):
            return None
    else:
        name, colon, port = value.partition(":")
        rest = colon + port
    if rest and not (rest[0] == ":" and (rest[1:].isdigit() or rest == ":")):
        return None
    name = name[:-1] if name.endswith(".") and not _is_ip(name) else name
    return name if name and (_is_ip(name) or _NAME.match(name)) else None


def check_host_name(name: str) -> str:
    """``name`` as ``--allow-host`` stores it (lowercased); :class:`ServeError` if it is no
    host name or address."""
    found = host_name(name) if name and "/" not in name else None
    if found is None or (":" in name and not _is_ip(found)):
        raise ServeError(f"--allow-host '{inert_text(name, 80)}' is not a host name or address; "
                         "write the name browsers use, e.g. --allow-host gpu1.lab.example")
    return found


def _machine_names() -> set[str]:
    names = set()
    for name in (socket.gethostname(), socket.getfqdn()):
        found = host_name(name) if name else None
        if found and not _is_ip(found):
            names.update({found, found.split(".", 1)[0]})
    return names


@dataclass(frozen=True)
class HostPolicy:
    """The host names a server answers to (IP literals and ``localhost`` always)."""

    names: frozenset[str]

    @classmethod
    def for_bind(cls, address: str, allow: Iterable[str] = ()) -> HostPolicy:
        """The policy for a server bound to ``address`` (numeric), plus ``allow``'d names."""
        names = set(_ALWAYS) | {check_host_name(n) for n in allow}
        try:
            loopback = ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            names |= _machine_names()
        return cls(frozenset(names))

    def accepts(self, name: str | None) -> bool:
        return name is not None and (_is_ip(name) or name in self.names)

    def refusal(self, host: str | None, origin: str | None) -> str | None:
        """The 403 body for a request with these ``Host`` and ``Origin`` values; None if fine."""
        if host is not None and host.strip():
            if not self.accepts(host_name(host)):
                return _refused("Host", host, host_name(host))
        if origin is not None:
            name = None
            try:
                parts = urlsplit(origin.strip())
                if parts.scheme in ("http", "https") and parts.hostname:
                    name = host_name(parts.hostname)
            except ValueError:
                name = None
            if not self.accepts(name):
                return _refused("Origin", origin, name)
        return None


def _refused(header: str, value: str, name: str | None) -> str:
    fix = f"--allow-host {name}" if name and not _is_ip(name) else "--allow-host NAME"
    return (f"devicekit serve: refused {header} '{inert_text(value, 100)}': not a name this server "
            f"answers to (a guard against DNS rebinding); if it is this machine's, restart "
            f"devicekit serve with {fix}\n")
