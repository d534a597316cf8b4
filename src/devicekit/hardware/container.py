"""Is this process in a PID namespace of its own (a container)? Then NVML's pids are the host's.

NVML reports the pids of the processes on a GPU as the *host* numbers them. In a container with
its own PID namespace (Docker, Kubernetes, Podman by default) those pids mean nothing here: the
processes cannot be named, their users are unknown, and ``devicekit status`` shows GPUs as used
by nobody. This module says so instead of staying silent. Signs, strongest first:

- ``/proc/self/ns/pid`` is not the kernel's initial PID namespace (inode ``0xEFFFFFFC``);
- NVML lists pids that do not exist in this process's ``/proc``;
- container hints (``/.dockerenv``, ``/run/.containerenv``, Kubernetes variables), which alone
  prove nothing (a VM built from a container image has them too) and are only reported.

Leases are files in the lease directory: they cover the processes that share it (the same
machine, or containers that mount the same directory), never processes outside.

Usage::

    from devicekit.hardware.container import pid_isolation

    iso = pid_isolation(gpu_pids=[4242])
    if iso.note():
        print(iso.note())
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PidIsolation", "pid_isolation", "HOST_PID_NAMESPACE", "PROC"]

#: the kernel's initial PID namespace inode (PROC_PID_INIT_INO): the host's own
HOST_PID_NAMESPACE = 0xEFFFFFFC
#: where /proc is (a test points this at a fake one)
PROC = Path("/proc")
ROOT = Path("/")


@dataclass(frozen=True)
class PidIsolation:
    """What this process can tell about its PID namespace."""

    #: True: a namespace of its own; False: the host's; None: cannot tell (no /proc)
    own_namespace: bool | None
    #: GPU process pids (from NVML) that do not exist here
    foreign_pids: tuple[int, ...] = ()
    #: container hints found (files, variables); informative only
    hints: tuple[str, ...] = ()

    @property
    def hides_gpu_users(self) -> bool:
        return bool(self.own_namespace) or bool(self.foreign_pids)

    def note(self) -> str | None:
        """One line for ``status``/``doctor`` when GPU users cannot be seen from here; else None."""
        if not self.hides_gpu_users:
            return None
        why = ("this process runs in a PID namespace of its own (a container)"
               if self.own_namespace else
               f"NVML reports pid(s) {', '.join(map(str, self.foreign_pids[:3]))} that do not"
               " exist here (a container?)")
        return (f"{why}: NVML reports host pids, so GPU processes outside it show without user or"
                " command; devicekit leases cover only processes sharing this lease directory")


def pid_isolation(gpu_pids: Iterable[int] = (), environ: Mapping[str, str] | None = None) -> PidIsolation:
    """Look at ``/proc`` (and the GPU pids NVML gave) to tell whether GPU users are hidden."""
    environ = os.environ if environ is None else environ
    return PidIsolation(_own_namespace(), _foreign(gpu_pids), _hints(environ))


def _own_namespace() -> bool | None:
    try:
        link = os.readlink(PROC / "self" / "ns" / "pid")  # "pid:[4026531836]"
    except OSError:
        return None
    digits = link.rsplit("[", 1)[-1].rstrip("]")
    if not digits.isdigit():
        return None
    return int(digits) != HOST_PID_NAMESPACE


def _foreign(pids: Iterable[int]) -> tuple[int, ...]:
    if not (PROC / "self").exists():
        return ()
    return tuple(sorted({pid for pid in pids if pid > 0 and not (PROC / str(pid)).exists()}))


def _hints(environ: Mapping[str, str]) -> tuple[str, ...]:
    found = [str(ROOT / name) for name in (".dockerenv", "run/.containerenv") if (ROOT / name).exists()]
    if "KUBERNETES_SERVICE_HOST" in environ:
        found.append("KUBERNETES_SERVICE_HOST")
    try:
        cgroup = (PROC / "1" / "cgroup").read_text(errors="replace")
    except OSError:
        cgroup = ""
    found += [f"{word} in /proc/1/cgroup" for word in ("docker", "kubepods", "containerd", "lxc")
              if word in cgroup]
    return tuple(found)
