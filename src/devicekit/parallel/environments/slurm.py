"""Slurm (``srun``): ranks from SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS, master from the node list.

The master address is the first host of SLURM_JOB_NODELIST (bracket ranges such as
``node[01-03,07]`` are expanded here, no ``scontrol`` subprocess); the port is derived from
SLURM_JOB_ID so every task of one job agrees without talking. MASTER_ADDR / MASTER_PORT win
when set. An interactive allocation shell (``salloc``/``srun --pty bash``) and the sbatch
script itself (no srun step id: SLURM_NTASKS is the job's, but no other task runs yet) are not
tasks of a world and are treated as a plain process, by ``dk.dist`` and ``devicekit run`` alike.
Node lists may be comma- or space-separated.

Usage::

    from devicekit.parallel.environments.slurm import expand_nodelist

    expand_nodelist("gpu[01-03,07],login1")   # ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1']
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

from devicekit.errors import DistributedError
from devicekit.hardware.slurm_job import in_slurm_job, is_batch_script
from devicekit.parallel.environments.base import DistEnv, Environment, integer_variable

__all__ = ["SlurmEnvironment", "expand_nodelist", "tasks_per_node", "port_for_job"]

class SlurmEnvironment(Environment):
    """Tasks started by ``srun`` inside a Slurm job (not the batch script, not ``salloc``'s shell)."""

    name = "slurm"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return in_slurm_job(environ) and not is_batch_script(environ)

    def read(self) -> DistEnv:
        e = self.environ
        rank = integer_variable(e, "SLURM_PROCID")
        world = integer_variable(e, "SLURM_NTASKS")
        nodelist = e.get("SLURM_JOB_NODELIST") or e.get("SLURM_NODELIST") or ""
        hosts = expand_nodelist(nodelist) if nodelist else []
        nnodes = integer_variable(e, "SLURM_NNODES", integer_variable(e, "SLURM_JOB_NUM_NODES", max(len(hosts), 1)))
        node_rank = integer_variable(e, "SLURM_NODEID", 0)
        per_node = tasks_per_node(e.get("SLURM_STEP_TASKS_PER_NODE") or e.get("SLURM_TASKS_PER_NODE") or "")
        if per_node and node_rank < len(per_node):
            local_world = per_node[node_rank]
        else:
            local_world = integer_variable(e, "SLURM_NTASKS_PER_NODE", max(world // max(nnodes, 1), 1))
        master = e.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1")
        if "MASTER_PORT" in e:
            port = integer_variable(e, "MASTER_PORT")
        else:
            port = port_for_job(e.get("SLURM_JOB_ID", ""))
        return self.check(
            DistEnv(
                rank=rank,
                local_rank=integer_variable(e, "SLURM_LOCALID", 0),
                world_size=world,
                local_world_size=local_world,
                node_rank=node_rank,
                nnodes=nnodes,
                master_addr=master,
                master_port=port,
                source=self.name,
            )
        )


def port_for_job(job_id: str) -> int:
    """A port in 15000-29999 derived from the job id, the same on every task of the job.

    It stays below Linux's ephemeral range (32768+): a rank retrying ``connect()`` to an
    ephemeral port nobody listens on yet can be handed that very port and connect to itself.
    """
    digits = re.sub(r"\D", "", job_id)
    if not digits:
        return 29500
    return 15000 + int(digits) % 15000


def tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE such as ``"2(x3),1"`` into ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            raise DistributedError(
                f"SLURM_TASKS_PER_NODE={spec!r} cannot be parsed (expected e.g. '2(x3),1')"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list (``"a[1-3,5],b-[01-02]-ib,c"``) into host names, in order.

    Several bracket groups in one name expand as a product (``r[1-2]n[1-2]`` gives four
    hosts); zero padding follows the range's first number, as Slurm does.
    """
    hosts: list[str] = []
    for name in _split_top_level(nodelist):
        pieces = re.split(r"(\[[^\]]*\])", name)
        choices: list[list[str]] = []
        for piece in pieces:
            if piece.startswith("["):
                choices.append(_expand_brackets(nodelist, piece[1:-1]))
            elif "[" in piece or "]" in piece:
                raise DistributedError(f"node list {nodelist!r} has an unbalanced bracket")
            else:
                choices.append([piece])
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    names, depth, current = [], 0, []
    for char in nodelist.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise DistributedError(f"node list {nodelist!r} has an unbalanced bracket")
        if (char == "," or char.isspace()) and depth == 0:  # "a,b" or "a b c"
            names.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise DistributedError(f"node list {nodelist!r} has an unbalanced bracket")
    names.append("".join(current))
    return [n.strip() for n in names if n.strip()]


def _expand_brackets(nodelist: str, inner: str) -> list[str]:
    values: list[str] = []
    for item in inner.split(","):
        item = item.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if match is None:
            raise DistributedError(
                f"node list {nodelist!r}: range {item!r} is not a number or 'a-b'"
            )
        start, end = match.group(1), match.group(2)
        if end is None:
            values.append(start)
            continue
        if int(end) < int(start):
            raise DistributedError(f"node list {nodelist!r}: range {item!r} runs backwards")
        width = len(start)
        values.extend(str(n).zfill(width) for n in range(int(start), int(end) + 1))
    return values
