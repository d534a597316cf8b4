"""Which job ``devicekit run`` joins: its own flags, or the launcher it runs under.

:func:`resolve_world` checks the node flags (``--nnodes N|MIN:MAX``, ``--node-rank``,
``--master-addr/--master-port``, torchrun's ``--rdzv-*`` and ``--standalone``) before anything
is leased, and reconciles them with an outer launcher (:mod:`devicekit.jobs.outer`): a flag
that agrees with the launcher is accepted, one that contradicts it is refused with one line;
nothing is overwritten silently. The result says whether the command runs as one rank the
launcher started (``World.task``) or under torchrun with these node options.

Usage::

    from devicekit.jobs.request import RunRequest
    from devicekit.jobs.run_world import resolve_world

    world = resolve_world(RunRequest(procs=2), environ={})
    world.standalone      # True: one node, torchrun's own rendezvous on a free port
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from devicekit.errors import DeviceKitError, InvalidValueError, LaunchError
from devicekit.hardware.launchers import DistEnv, slurm_place
from devicekit.hardware.launchers.base import check_resolvable, is_loopback
from devicekit.hardware.launchers.slurm_nodes import expand_nodelist
from devicekit.jobs.outer import OuterJob, detect_outer, parse_nnodes

if TYPE_CHECKING:
    from devicekit.jobs.request import RunRequest

__all__ = ["World", "resolve_world", "RDZV_BACKENDS"]

RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")

#: per source, the variables that say (node count, node rank, master address, master port)
_SAYS = {
    "slurm": ("SLURM_NNODES", "SLURM_NODEID", "MASTER_ADDR / SLURM_JOB_NODELIST",
              "MASTER_PORT / SLURM_JOB_ID"),
    "mpi": ("the MPI rank placement", "the MPI rank placement", "MASTER_ADDR", "MASTER_PORT"),
    "torchrun": ("GROUP_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"),
    "devicekit": ("GROUP_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"),
    "kubeflow": ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"),
    "pet": ("PET_NNODES", "PET_NODE_RANK / RANK", "PET_MASTER_ADDR / MASTER_ADDR",
            "PET_MASTER_PORT / MASTER_PORT"),
}


@dataclass
class World:
    """The job this node's processes join."""

    nnodes: str = "1"
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    #: torchrun's standalone rendezvous: one node, a free port chosen by the OS at bind time
    standalone: bool = False
    #: every "node" runs on this host (a loopback master with several nodes)
    loopback_rehearsal: bool = False
    outer: OuterJob | None = None
    #: the rank a launcher started: run the command directly as it (no torchrun)
    task: DistEnv | None = None
    #: processes per node the launcher asks for (PET_NPROC_PER_NODE), when the flags do not
    default_procs: int | str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def max_nodes(self) -> int:
        return parse_nnodes(self.nnodes)[1]

    @property
    def own(self) -> bool:
        """A job of devicekit run's own on this one machine (no launcher, one node)."""
        return self.outer is None and self.max_nodes == 1


def resolve_world(request: RunRequest, environ: Mapping[str, str]) -> World:
    """The world for ``request`` run in ``environ``; one-line errors for bad or clashing flags."""
    _check_values(request)
    outer = detect_outer(environ)
    world = _own(request) if outer is None else _under(outer, request)
    if outer is None:
        world.notes.extend(_slurm_shell_note(environ))
    if world.max_nodes > 1:
        _check_master(world)
    return world


def _slurm_shell_note(environ: Mapping[str, str]) -> list[str]:
    """salloc's shell runs where salloc was typed, which need not be a node of the job: say so
    (its GPUs are that host's, not the allocation's)."""
    place = slurm_place(environ)
    if place.kind != "shell" or place.step is not None:
        return []
    nodes = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    try:
        hosts = expand_nodelist(nodes)
    except DeviceKitError:
        hosts = []
    here = socket.gethostname().split(".")[0]
    if not hosts or here in hosts:
        return []
    return [f"this is salloc's shell of Slurm job {place.job_id} on {here}, which is not one of"
            f" the job's nodes ({nodes}): the GPUs are {here}'s, not the allocation's; start it"
            " in the job with: srun devicekit run ..."]


def asked_procs(request: RunRequest) -> int | str | None:
    """Processes per node the flags ask for: a count, "all" (one per eligible GPU) or None."""
    if request.gpu_ids:
        return max(len(request.gpu_ids) // request.gpus_per_proc, 1)
    if request.gpus is not None:
        text = str(request.gpus).strip().lower()
        if text == "all":
            return "all"
        try:
            return max(int(text) // request.gpus_per_proc, 1)
        except ValueError:
            return None  # the allocation names the bad value
    return request.procs


def _check_values(request: RunRequest) -> None:
    parse_nnodes(request.nnodes or "1")
    if request.node_rank is not None and request.node_rank < 0:
        raise InvalidValueError(f"--node-rank {request.node_rank} must be 0 or more")
    if request.master_port is not None and not 0 < request.master_port < 65536:
        raise InvalidValueError(f"--master-port {request.master_port} is not a TCP port (1-65535)")
    if request.rdzv_backend is not None and request.rdzv_backend not in RDZV_BACKENDS:
        raise InvalidValueError(
            f"--rdzv-backend {request.rdzv_backend!r} is not one of {', '.join(RDZV_BACKENDS)}")
    if request.max_restarts is not None and request.max_restarts < 0:
        raise InvalidValueError(f"--max-restarts {request.max_restarts} must be 0 or more")
    if request.master_addr is not None and request.rdzv_endpoint is not None:
        raise InvalidValueError(
            "--master-addr and --rdzv-endpoint both name the rendezvous host; give one"
            " (--rdzv-endpoint HOST:PORT with --rdzv-backend c10d)")
    if request.standalone and (request.rdzv_backend or request.rdzv_endpoint
                               or request.master_addr or request.master_port):
        raise InvalidValueError(
            "--standalone picks its own rendezvous on a free port; drop --rdzv-*/--master-*")


def _own(request: RunRequest) -> World:
    """No launcher: the flags alone (one machine by default)."""
    nnodes = (request.nnodes or "1").strip()
    low, high = parse_nnodes(nnodes)
    world = World(nnodes, request.node_rank, request.master_addr, request.master_port,
                  request.rdzv_backend, request.rdzv_endpoint, request.rdzv_id)
    dynamic = (request.rdzv_backend or "static") != "static"
    if request.standalone and high > 1:
        raise InvalidValueError(f"--standalone is for one node but --nnodes is {nnodes}; drop one")
    if low != high and not dynamic:
        raise InvalidValueError(
            f"--nnodes {nnodes} is elastic: add --rdzv-backend c10d --rdzv-endpoint HOST:PORT"
            " --rdzv-id JOB (the static rendezvous needs a fixed node count)")
    if dynamic and request.rdzv_endpoint is None:
        raise InvalidValueError(
            f"--rdzv-backend {request.rdzv_backend} needs --rdzv-endpoint HOST:PORT (the host every"
            " node can reach)")
    if high > 1 and not dynamic:
        if request.master_addr is None and request.rdzv_endpoint is None:
            raise InvalidValueError(f"--nnodes {nnodes} needs --master-addr (the host name of node 0)")
        if request.node_rank is None:
            raise InvalidValueError(
                f"--nnodes {nnodes} needs --node-rank (0 to {high - 1}) on every node")
    if request.node_rank is not None and request.node_rank >= high:
        raise InvalidValueError(f"--node-rank {request.node_rank} must be between 0 and {high - 1}")
    if high == 1 and request.master_port is None and request.rdzv_endpoint is None:
        # torchrun's own rendezvous on localhost:0 with a fresh id, on every torch (older ones
        # would otherwise use 29500 and two concurrent runs would collide)
        world.standalone = True
    return world


def _under(outer: OuterJob, request: RunRequest) -> World:
    """Inside a launcher's job: take its world; refuse flags that contradict it."""
    says = _SAYS.get(outer.source, ("its variables",) * 4)
    for flag, mine, theirs, var in (
        ("--nnodes", request.nnodes, outer.nnodes, says[0]),
        ("--node-rank", request.node_rank, outer.node_rank, says[1]),
        ("--master-addr", request.master_addr, outer.master_addr, says[2]),
        ("--master-port", request.master_port, outer.master_port, says[3]),
        ("--rdzv-backend", request.rdzv_backend, outer.rdzv_backend, "PET_RDZV_BACKEND"),
        ("--rdzv-endpoint", request.rdzv_endpoint, outer.rdzv_endpoint, "PET_RDZV_ENDPOINT"),
        ("--rdzv-id", request.rdzv_id, outer.rdzv_id, "PET_RDZV_ID"),
    ):
        if mine is not None and str(mine).strip() != str(theirs).strip():
            their = "nothing" if theirs is None else repr(str(theirs))
            raise LaunchError(
                f"{flag} {mine} but {outer.launcher} says {their} ({var}); drop {flag}:"
                " devicekit run takes the job's shape from the launcher it runs under")
    if request.standalone and outer.max_nodes > 1:
        raise LaunchError(f"--standalone is for one node but {outer.launcher} runs"
                          f" {outer.nnodes} nodes; drop --standalone")
    world = World(outer.nnodes, outer.node_rank, outer.master_addr, outer.master_port,
                  outer.rdzv_backend, outer.rdzv_endpoint, outer.rdzv_id, outer=outer)
    world.notes.append(f"running under {outer.describe()}")
    asked = asked_procs(request)
    if outer.task is None:  # PET_*: torchrun on this node
        world.default_procs = _pet_procs(outer, request, asked)
        return world
    task = outer.task
    several = asked == "all" or (asked is not None and int(asked) > 1)
    if not several:
        torchrun_only = [flag for flag, value in (("--max-restarts", request.max_restarts),
                                                  ("--log-dir", request.log_dir),
                                                  ("--standalone", request.standalone)) if value]
        if torchrun_only:
            raise LaunchError(
                f"{torchrun_only[0]} is a torchrun option, but {outer.launcher} started the ranks"
                f" itself; start one task per node (e.g. srun --ntasks-per-node=1) so devicekit"
                " run starts torchrun there")
        world.task = task
        world.notes.append(
            f"running the command as rank {task.rank} of {task.world_size} (no torchrun: the"
            " launcher started the ranks)")
        return world
    if outer.source in ("torchrun", "devicekit"):
        raise LaunchError(
            f"devicekit run is already a rank of {outer.launcher} (RANK={task.rank},"
            f" WORLD_SIZE={task.world_size}); asking it for {asked} processes would nest a second"
            " torchrun: run 'devicekit run --nproc-per-node N' instead of torchrun, or drop"
            " --gpus/--procs")
    if task.local_world_size > 1:
        raise LaunchError(
            f"{outer.launcher} started {task.local_world_size} tasks on this node, each one rank;"
            f" --gpus/--procs asking for {asked} processes per task would start"
            f" {task.local_world_size} separate jobs: drop them (each task leases"
            f" --gpus-per-proc GPU(s)), or start one task per node (srun --ntasks-per-node=1,"
            " mpirun --npernode 1)")
    if task.world_size != task.nnodes:
        raise LaunchError(
            f"{outer.launcher} started {task.world_size} tasks on {task.nnodes} nodes, unevenly;"
            " start exactly one task per node for devicekit run to start torchrun on each")
    world.notes.append(f"torchrun on node {task.node_rank} of {task.nnodes}, as {outer.launcher}"
                       " placed this task")
    return world


def _pet_procs(outer: OuterJob, request: RunRequest, asked: int | str | None) -> int | str | None:
    """PET_NPROC_PER_NODE as the default process count; a clash with the flags is refused."""
    pet = outer.nproc_per_node
    if pet is None:
        return None
    if pet.isdigit():
        if asked is not None and str(asked) != pet:
            raise LaunchError(
                f"--gpus/--procs ask for {asked} processes on this node but PET_NPROC_PER_NODE={pet}"
                f" ({outer.launcher}); drop them, or make them agree")
        return int(pet)
    if pet in ("auto", "gpu"):
        return asked if asked is not None else "all"
    raise LaunchError(
        f"PET_NPROC_PER_NODE={pet!r} is not a count, 'auto' or 'gpu'; set --procs N explicitly"
        " and unset it")


def _check_master(world: World) -> None:
    """Several nodes: a master every node can reach (a loopback one only as a rehearsal)."""
    host = world.master_addr
    if world.rdzv_endpoint is not None:
        host = world.rdzv_endpoint.rsplit(":", 1)[0] if ":" in world.rdzv_endpoint.strip("[]") \
            else world.rdzv_endpoint
    if host is None:
        if world.outer is not None:
            raise LaunchError(
                f"{world.outer.launcher} spans {world.nnodes} nodes but no variable names the"
                " master; export MASTER_ADDR=<host of rank 0> to every task")
        return
    given = world.outer is None or world.outer.master_given
    if is_loopback(host):
        if not given:
            raise LaunchError(
                f"{world.outer.launcher if world.outer else 'the job'} spans {world.nnodes}"
                f" nodes but the master address defaults to {host}; export MASTER_ADDR=<host of"
                " rank 0> to every task (mpirun -x MASTER_ADDR=...)")
        world.loopback_rehearsal = True
        world.notes.append(
            f"master address {host} is loopback: all {world.nnodes} nodes must run on this host"
            " (a rehearsal); use the master's host name for real machines")
    what = "--rdzv-endpoint" if world.rdzv_endpoint else "--master-addr"
    if world.outer is not None:
        what = f"master address from {world.outer.launcher}"
    check_resolvable(host, what)
