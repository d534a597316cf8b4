"""Slurm's view of this node's GPUs: this job's allocation and the GPUs other jobs hold.

Read from ``squeue`` and ``scontrol -d show job`` when they are on PATH (nothing changes where
they are not, or outside a Slurm node), each call bounded in time and in output, so
``devicekit status`` and ``doctor`` never wait on a slow controller. GPUs are numbered as Slurm
numbers them (``GRES=gpu:2(IDX:0-1)``: the order of gres.conf, the NVML index on a usual node).
What ``scontrol`` prints is the controller's word about other users' jobs: parsed by pattern,
bounded, and shown inert.

Usage::

    from devicekit.hardware.slurm_node import slurm_view

    view = slurm_view(os.environ)
    if view is not None:
        print("\\n".join(view.lines()))   # Slurm job 12 (srun step 0, ...): GPUs 0,1 of dknode
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from devicekit.errors import DeviceKitError
from devicekit.hardware.check_result import Check
from devicekit.hardware.launchers import slurm_place
from devicekit.hardware.launchers.slurm_nodes import expand_nodelist
from devicekit.hardware.printable import printable

__all__ = ["SlurmJobGpus", "SlurmView", "slurm_view", "check_slurm", "parse_job_gpus"]

#: seconds all Slurm commands of one view may take together; jobs on one node looked at
DEADLINE, MAX_JOBS, MAX_OUTPUT = 3.0, 32, 256 * 1024
_JOB_ID = re.compile(r"\d{1,20}(?:_\d{1,10})?")


@dataclass(frozen=True)
class SlurmJobGpus:
    """A running job's GPUs on this node (Slurm's gres indices)."""

    job_id: str
    user: str
    gpus: tuple[int, ...]


@dataclass
class SlurmView:
    """This node as Slurm sees it; ``job_id`` is None outside a job."""

    node: str | None
    job_id: str | None = None
    where: str = ""
    own_gpus: tuple[int, ...] | None = None
    others: list[SlurmJobGpus] = field(default_factory=list)
    problem: str | None = None

    @property
    def taken(self) -> dict[int, SlurmJobGpus]:
        """GPU index -> the other job that holds it."""
        return {gpu: job for job in self.others for gpu in job.gpus}

    def lines(self) -> list[str]:
        """One line for this job, one per GPU another job holds, one for a problem."""
        out = []
        if self.job_id is not None:
            if self.own_gpus is None:
                gpus = "its GPUs unknown"
            elif not self.own_gpus:
                gpus = "no GPUs"
            else:
                gpus = "GPU " + ",".join(map(str, self.own_gpus))
            out.append(f"Slurm job {self.job_id} ({self.where}): {gpus} of node {self.node or '?'}")
        for gpu, job in sorted(self.taken.items()):
            out.append(f"GPU {gpu}: taken by Slurm job {job.job_id} ({job.user})")
        if self.problem:
            out.append(f"Slurm: {self.problem}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "job_id": self.job_id, "where": self.where or None,
                "gpus": list(self.own_gpus) if self.own_gpus is not None else None,
                "taken": [{"gpu": g, "job_id": j.job_id, "user": j.user}
                          for g, j in sorted(self.taken.items())],
                "problem": self.problem}


def slurm_view(environ: Mapping[str, str] | None = None, *, deadline: float = DEADLINE) -> SlurmView | None:
    """Slurm's view of this node, or None where Slurm has nothing to say (no job, no tools)."""
    environ = os.environ if environ is None else environ
    place = slurm_place(environ)
    job = place.job_id
    if shutil.which("squeue") is None or shutil.which("scontrol") is None:
        if job is None:
            return None
        return SlurmView(environ.get("SLURMD_NODENAME"), job, place.where,
                         problem="squeue/scontrol are not on PATH: the allocation's GPUs are unknown")
    ends = time.monotonic() + deadline
    try:
        node = environ.get("SLURMD_NODENAME") or _this_node(ends)
        if node is None:
            return None if job is None else SlurmView(None, job, place.where)
        view = SlurmView(node, job, place.where)
        for other in _jobs_on(node, ends):
            gpus = _job_gpus(other, node, ends)
            if gpus is None:
                continue
            if job is not None and gpus.job_id in (job, environ.get("SLURM_JOB_ID")):
                view.own_gpus = gpus.gpus
            elif gpus.gpus:
                view.others.append(gpus)
        return view
    except _Unanswered as exc:  # outside a job: not a Slurm node here, nothing to say
        if job is None:
            return None
        return SlurmView(environ.get("SLURMD_NODENAME"), job, place.where, problem=str(exc))


def check_slurm(environ: Mapping[str, str] | None = None) -> Check | None:
    """Doctor's check of the Slurm job this runs in (None outside one): its id and its GPUs."""
    view = slurm_view(environ)
    if view is None or view.job_id is None:
        return None
    lines = view.lines()
    return Check("slurm", "warn" if view.problem else "pass", "; ".join(lines))


class _Unanswered(DeviceKitError):
    """A Slurm command failed or ran past the deadline."""


def _run(argv: list[str], ends: float) -> str:
    left = ends - time.monotonic()
    if left <= 0:
        raise _Unanswered(f"{argv[0]} did not answer within {DEADLINE:g} s")
    try:
        done = subprocess.run(argv, capture_output=True, timeout=left, check=False,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise _Unanswered(f"{argv[0]} did not answer within {DEADLINE:g} s") from None
    except OSError as exc:
        raise _Unanswered(f"{argv[0]} cannot run ({exc.strerror})") from None
    if done.returncode != 0:
        first = done.stderr.decode(errors="replace").strip().splitlines()[:1]
        raise _Unanswered(f"{' '.join(argv[:2])} failed: {printable(first[0] if first else '?')[:120]}")
    return done.stdout[:MAX_OUTPUT].decode(errors="replace")


def _this_node(ends: float) -> str | None:
    """The Slurm node this host is (by NodeHostName or NodeName), None on a machine that is none."""
    host = socket.gethostname()
    short = host.split(".")[0]
    for line in _run(["scontrol", "-o", "show", "node"], ends).splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if host in (fields.get("NodeHostName"), fields.get("NodeName")) or short in (
                fields.get("NodeHostName"), fields.get("NodeName")):
            return fields.get("NodeName")
    return None


def _jobs_on(node: str, ends: float) -> list[str]:
    out = _run(["squeue", "-h", "-w", node, "-t", "RUNNING,SUSPENDED", "-o", "%A"], ends)
    return [j for j in out.split() if _JOB_ID.fullmatch(j)][:MAX_JOBS]


def _job_gpus(job_id: str, node: str, ends: float) -> SlurmJobGpus | None:
    return parse_job_gpus(_run(["scontrol", "-d", "-o", "show", "job", job_id], ends), node)


def parse_job_gpus(text: str, node: str) -> SlurmJobGpus | None:
    """A job's GPUs on ``node`` from one line of ``scontrol -d -o show job``; None if unreadable."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    job = re.search(r"\bJobId=(\d{1,20})\b", line)
    if job is None:
        return None
    array = re.search(r"\bArrayJobId=(\d{1,20}) ArrayTaskId=(\d{1,10})\b", line)
    job_id = f"{array.group(1)}_{array.group(2)}" if array else job.group(1)
    user = re.search(r"\bUserId=([A-Za-z0-9._-]{1,32})\(", line)
    gpus: list[int] = []
    for nodes, gres in re.findall(r"\bNodes=(\S+) CPU_IDs=\S+ Mem=\S+ GRES=(\S*)", line):
        try:
            here = node in expand_nodelist(nodes)
        except DeviceKitError:
            continue
        if here:
            for spec in re.findall(r"gpu(?::[^:(,]+)?:\d+\(IDX:([0-9,-]+)\)", gres):
                gpus.extend(_indices(spec))
    return SlurmJobGpus(job_id, user.group(1) if user else "?", tuple(sorted(set(gpus))))


def _indices(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        low, _, high = part.partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            out.extend(range(int(low), int(high or low) + 1)[:1024])
    return out
