"""Slurm: where in a job this process is, decided from the step, and an srun task's rank facts.

Slurm starts processes four ways, and the variables tell them apart by the *step* (never by
the job's name; the values below were recorded from a real slurmd 22.05, see
``tests/hardware/slurm_environments.json``):

===========================  ===============================  ============================
how it started               variables                        what devicekit makes of it
===========================  ===============================  ============================
``salloc``'s shell           SLURM_JOB_ID, no SLURM_PROCID,   ``shell``: one process, a
                             no SLURM_STEP_ID                 world of one
salloc's interactive step    SLURM_STEP_ID=4294967290         ``shell`` (as above)
(``use_interactive_step``)
the ``sbatch`` script        SLURM_PROCID=0, no step id (or   ``batch``: one process, a
                             4294967294, the batch step)      world of one
an ``srun`` task (in sbatch  SLURM_STEP_ID=0,1,...,           ``task``: rank SLURM_PROCID
or salloc, wrapped in        SLURM_PROCID, SLURM_STEP_NUM_    of SLURM_STEP_NUM_TASKS
``bash -c`` or not)          TASKS
===========================  ===============================  ============================

A task's world is its *step's* (SLURM_STEP_NUM_TASKS, SLURM_STEP_TASKS_PER_NODE,
SLURM_STEP_NODELIST; the job-wide variables are the fallback), so ``srun -n 2`` inside
``salloc -n 4`` is a world of two. Task variables without a step id (SLURM_PROCID=3 and no
SLURM_STEP_ID: an environment copied by hand) are refused with one line, never read as a
world of one. The master address is the first host of the step's node list (bracket ranges
expanded by :mod:`~devicekit.hardware.launchers.slurm_nodes`, no ``scontrol``); the port is
derived from the job and step ids so every task of a step agrees without talking, and two
steps of one job running side by side do not collide. MASTER_ADDR / MASTER_PORT win when set.

Usage::

    from devicekit.hardware.launchers.slurm import slurm_place

    place = slurm_place(os.environ)
    print(place.kind, place.job_id, place.describe())   # task 12345 srun task 1 of 2 ...
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from devicekit.errors import DistributedError
from devicekit.hardware.launchers.base import DistEnv, Environment, integer_variable
from devicekit.hardware.launchers.slurm_nodes import expand_nodelist, tasks_per_node

__all__ = ["SlurmEnvironment", "SlurmPlace", "slurm_place", "slurm_job_id", "port_for_job",
           "expand_nodelist", "tasks_per_node", "BATCH_STEP", "EXTERN_STEP", "INTERACTIVE_STEP"]

#: Slurm's ids of the steps that are not srun tasks (SLURM_BATCH_SCRIPT, SLURM_EXTERN_CONT,
#: SLURM_INTERACTIVE_STEP in slurm.h); older Slurm spells the first two as words
BATCH_STEP, EXTERN_STEP, INTERACTIVE_STEP = "4294967294", "4294967295", "4294967290"
_SHELL_STEPS = {INTERACTIVE_STEP: "salloc's interactive step", EXTERN_STEP: "the extern step",
                "extern": "the extern step"}
_SHELL = "salloc's shell"
_JOB_ID = re.compile(r"\d{1,20}(?:_\d{1,10})?")


@dataclass(frozen=True)
class SlurmPlace:
    """Where this process sits in a Slurm job.

    ``kind``: ``"none"`` (no job), ``"shell"`` (salloc's shell or interactive step, the extern
    step), ``"batch"`` (the sbatch script), ``"task"`` (a task srun started) or ``"unclear"``
    (task variables without a step id). ``job_tasks``: the job's SLURM_NTASKS (1 if unset).
    """

    kind: str
    job_id: str | None = None
    step: str | None = None
    job_tasks: int = 1
    where: str = ""

    def describe(self) -> str:
        """One line: ``Slurm job 12 (the sbatch script, 2 task(s) in the job)``."""
        if self.kind == "none":
            return "not in a Slurm job"
        tasks = f", {self.job_tasks} task(s) in the job" if self.outside_step else ""
        return f"Slurm job {self.job_id or '?'} ({self.where}{tasks})"

    @property
    def outside_step(self) -> bool:
        """The batch script or an allocation shell: no other task of the job runs beside it."""
        return self.kind in ("shell", "batch")


def slurm_job_id(environ: Mapping[str, str]) -> str | None:
    """The job id as ``squeue`` shows it: ``12345``, or ``12340_5`` for task 5 of an array."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID", "").strip(), environ.get("SLURM_ARRAY_TASK_ID", "").strip()
    job = f"{array}_{task}" if array and task else environ.get("SLURM_JOB_ID", "").strip()
    return job if _JOB_ID.fullmatch(job) else None


def slurm_place(environ: Mapping[str, str]) -> SlurmPlace:
    """Decide from the step variables (SLURM_STEP_ID, SLURM_PROCID) where this process is."""
    job = slurm_job_id(environ)
    procid = environ.get("SLURM_PROCID", "").strip()
    if job is None and not procid:
        return SlurmPlace("none")
    tasks = _count(environ, "SLURM_NTASKS")
    step = (environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or "").strip()
    if step in _SHELL_STEPS:
        return SlurmPlace("shell", job, step, tasks, _SHELL_STEPS[step])
    if step in (BATCH_STEP, "batch"):
        return SlurmPlace("batch", job, step, tasks, "the sbatch script")
    if step:
        return SlurmPlace("task", job, step, tasks, f"srun step {step}")
    if not procid:
        return SlurmPlace("shell", job, None, tasks, _SHELL)
    if procid == "0" and not any(name.startswith("SLURM_STEP_") for name in environ):
        return SlurmPlace("batch", job, None, tasks, "the sbatch script")
    return SlurmPlace("unclear", job, None, tasks, f"SLURM_PROCID={procid} without SLURM_STEP_ID")


def _count(environ: Mapping[str, str], name: str) -> int:
    raw = environ.get(name, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


class SlurmEnvironment(Environment):
    """A task ``srun`` started (not the batch script, not salloc's shell): its step's world."""

    name = "slurm"
    variables = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return slurm_place(environ).kind in ("task", "unclear")

    def read(self) -> DistEnv:
        e = self.environ
        place = slurm_place(e)
        if place.kind == "unclear":
            raise DistributedError(
                f"SLURM_PROCID={e.get('SLURM_PROCID')} but no SLURM_STEP_ID: this is neither an"
                " srun task nor the sbatch script (an environment copied by hand?); start the"
                " ranks with srun, or unset the SLURM_* variables for a single process")
        het = next((name for name in ("SLURM_HET_SIZE", "SLURM_PACK_SIZE") if name in e), None)
        if het is not None:  # the step's counts are per component: not read, so refused
            raise DistributedError(
                f"{het}={e.get(het)}: a heterogeneous Slurm job, whose task counts and node lists"
                " come per component (SLURM_*_HET_GROUP_N); devicekit does not read those yet:"
                " run the ranks in one component (a plain sbatch/salloc), or set RANK,"
                " WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT yourself")
        rank = integer_variable(e, "SLURM_PROCID")
        world = integer_variable(e, "SLURM_STEP_NUM_TASKS", integer_variable(e, "SLURM_NTASKS", 1))
        nodelist = (e.get("SLURM_STEP_NODELIST") or e.get("SLURM_JOB_NODELIST")
                    or e.get("SLURM_NODELIST") or "")
        hosts = expand_nodelist(nodelist) if nodelist else []
        nnodes = integer_variable(e, "SLURM_STEP_NUM_NODES", integer_variable(
            e, "SLURM_NNODES", integer_variable(e, "SLURM_JOB_NUM_NODES", max(len(hosts), 1))))
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
            port = port_for_job(e.get("SLURM_JOB_ID", ""), place.step or "0")
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


def port_for_job(job_id: str, step: str = "0") -> int:
    """A port in 15000-29999 from the job and step ids, the same on every task of the step.

    It stays below Linux's ephemeral range (32768+): a rank retrying ``connect()`` to an
    ephemeral port nobody listens on yet can be handed that very port and connect to itself.
    Step 0 keeps the job's port; each later step of the job moves 1009 ports on.
    """
    digits = re.sub(r"\D", "", job_id)
    if not digits:
        return 29500
    offset = 1009 * int(step) if step.isdigit() else 0
    return 15000 + (int(digits) + offset) % 15000
