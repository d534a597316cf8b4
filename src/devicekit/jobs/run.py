"""What ``devicekit run`` does: lease GPUs, build the command line, run it, supervise it.

One process on one node runs the command directly (with torchrun's variables for a world of
one, so a script written for torchrun runs unchanged); several processes or nodes run it under
torchrun (``python -m devicekit.jobs.torchrun_entry``: torchrun's own parser and agent, but
exiting with the failed rank's code instead of 1), which does the rendezvous. The child gets
CUDA_VISIBLE_DEVICES with the leased GPUs' UUIDs and inherits the lease file descriptors, so
the GPUs stay leased until the child itself has exited even if ``devicekit run`` is killed;
supervision (signals, exit codes, no orphans) is :mod:`devicekit.jobs.supervise`.
Under an outer launcher (srun, mpirun, torchrun, a Kubeflow pod) the world comes from it
(:mod:`devicekit.jobs.run_world`): the command runs as the rank the launcher started, or
torchrun runs on this node with the launcher's node count, node rank and master.

Usage::

    from devicekit.jobs.run import RunRequest, run

    code = run(RunRequest(gpus=2, command=["python", "train.py"]))
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable, Mapping

from devicekit.errors import LaunchError
from devicekit.hardware.check_result import take_inventory
from devicekit.hardware.inventory import backend
from devicekit.hardware.launchers import DistEnv
from devicekit.hardware.launchers.base import DEFAULT_PORT
from devicekit.hardware.launchers.torchrun import LAUNCH_MARKER, PUBLISHED_MARKER
from devicekit.hardware.printable import printable
from devicekit.jobs.allocation import Allocation, allocate
from devicekit.jobs.preflight import check_command, check_request, interpreter_warning
from devicekit.jobs.request import TORCHRUN_ENTRY, RunPlan, RunRequest
from devicekit.jobs.requeue import check_requeue
from devicekit.jobs.run_world import World, asked_procs, resolve_world
from devicekit.jobs.supervise import execute
from devicekit.jobs.threads import omp_threads, usable_cores
from devicekit.jobs.time_limit import declared_limit, enforced_limit
from devicekit.parallel.dist import GPUS_PER_PROC_ENV, LOOPBACK_OK_ENV, OWN_DEVICES_ENV

__all__ = ["RunRequest", "RunPlan", "plan_run", "execute", "run", "EXAMPLE_COMMAND",
           "rank_variables", "single_process_variables"]

#: the bundled example, run when no command is given
EXAMPLE_COMMAND = ("-m", "devicekit.examples")
#: variables a devicekit job sets for its ranks: stale in a new job's environment
_STALE = (LAUNCH_MARKER, OWN_DEVICES_ENV, LOOPBACK_OK_ENV, PUBLISHED_MARKER,
          "TORCHELASTIC_USE_AGENT_STORE")


def plan_run(request: RunRequest, environ: Mapping[str, str] | None = None) -> RunPlan:
    """Check the flags, lease the GPUs and build the command line (nothing is started yet)."""
    environ = dict(os.environ if environ is None else environ)
    check_request(request, environ)  # a flag without its value: one line, nothing leased
    world = resolve_world(request, environ)  # before any lease: a typo must not wait for it
    gpus, procs = _counts(request, world)
    limit = declared_limit(request.time_limit)
    allocation = allocate(
        gpus,
        procs,
        gpus_per_proc=request.gpus_per_proc,
        min_free_memory=request.min_free_memory,
        wait=request.wait,
        command=shlex.join(request.command) if request.command else "devicekit run (example)",
        gpu_ids=request.gpu_ids or None,
        exclude=request.exclude,
        max_utilization=request.max_utilization,
        time_limit=limit,
    )
    try:
        _check_torch_can_use(allocation)
        plan = _build(request, world, allocation, environ)
        planned = getattr(allocation.selection, "time_limit", None)
        if planned is not None and (limit is None or planned < limit):
            plan.notes.append(f"the queue planned this job with its ticket's time limit"
                              f" ({planned:g} s, its file was changed while waiting): that holds")
            limit = planned
        plan.time_limit = enforced_limit(limit, plan, allocation.on_gpu)
        plan.requeue = request.requeue
        if request.requeue:
            why = check_requeue(environ)
            if why is not None:
                plan.notes.append(why)
        warning = interpreter_warning(request.command, plan.env)  # 'python' without the venv
        if warning is not None:
            plan.notes.append(warning)
        return plan
    except BaseException:
        allocation.release()
        raise


def _counts(request: RunRequest, world: World) -> tuple[int | str | None, int | None]:
    """(gpus, procs) for the allocation: the flags, or one rank's share, or the launcher's count."""
    if world.task is not None:  # one rank the launcher started: its own --gpus-per-proc GPU(s)
        if request.gpus is not None or request.gpu_ids:
            return request.gpus, None
        return None, 1
    if asked_procs(request) is None and world.default_procs is not None:
        if world.default_procs == "all":
            from devicekit.hardware.inventory import gpus as inventory_gpus

            return ("all", None) if inventory_gpus() else (None, 1)
        return None, int(world.default_procs)
    return request.gpus, request.procs


def _build(request: RunRequest, world: World, allocation: Allocation,
           environ: Mapping[str, str]) -> RunPlan:
    notes = [*world.notes, allocation.reason,
             *(f"  not chosen: {line}" for line in allocation.rejected)]
    command = _command(request.command)
    env = {k: v for k, v in environ.items() if k not in _STALE}
    env[GPUS_PER_PROC_ENV] = str(request.gpus_per_proc)
    if allocation.on_gpu:
        env["CUDA_VISIBLE_DEVICES"] = allocation.cuda_visible_devices
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        notes.append(f"CUDA_VISIBLE_DEVICES={allocation.cuda_visible_devices}")
    if world.task is not None:
        if allocation.nprocs != 1:
            raise LaunchError(
                f"{allocation.nprocs} processes leased for one rank of {world.outer.launcher if world.outer else 'the launcher'};"
                " give --gpus equal to --gpus-per-proc")
        env.update(rank_variables(world.task))
        if "TORCHELASTIC_USE_AGENT_STORE" in environ and world.task.source == "torchrun":
            # a rank of a real torchrun: its agent serves the store at MASTER_PORT already
            env["TORCHELASTIC_USE_AGENT_STORE"] = environ["TORCHELASTIC_USE_AGENT_STORE"]
        if allocation.on_gpu:
            env[OWN_DEVICES_ENV] = "1"  # CUDA_VISIBLE_DEVICES holds this rank's GPU(s) alone
            notes.append("this rank sees only its own GPU(s), as cuda:0 (dk.dist.device() says so;"
                         " not cuda:LOCAL_RANK)")
        step, ranks = step_identity(world.task, environ)
        return RunPlan(command, env, allocation, notes, hang_timeout=request.hang_timeout,
                       log_dir=request.log_dir, step=step, step_ranks=ranks)
    # torchrun's own options: then even one process runs under torchrun, never ignoring them
    torchrun_only = (request.max_restarts or request.log_dir or request.standalone
                     or request.rdzv_backend or request.rdzv_endpoint or request.rdzv_id)
    if allocation.nprocs == 1 and world.own and not torchrun_only:
        # torchrun's variables for a world of one: a script written for torchrun runs as is
        env.update(single_process_variables(_free_port()))
        return RunPlan(command, env, allocation, notes)
    if world.loopback_rehearsal:
        env[LOOPBACK_OK_ENV] = "1"
    if allocation.nprocs > 1 and "OMP_NUM_THREADS" not in env:
        # deliberately, instead of torchrun's banner in every run setting it to 1
        threads = omp_threads(allocation.nprocs)
        env["OMP_NUM_THREADS"] = str(threads)
        notes.append(f"OMP_NUM_THREADS={threads} ({usable_cores()} usable cores /"
                     f" {allocation.nprocs} processes; set OMP_NUM_THREADS to choose)")
    argv = [sys.executable, "-m", TORCHRUN_ENTRY,  # torchrun, with the ranks' exit codes kept
            *torchrun_options(world, allocation.nprocs, request), "--no-python", *command]
    notes.append(_torchrun_note(world, allocation.nprocs))
    return RunPlan(argv, env, allocation, notes, hang_timeout=request.hang_timeout,
                   log_dir=request.log_dir)


def step_identity(task: DistEnv, environ: Mapping[str, str]) -> tuple[str | None, list[int] | None]:
    """For one rank of an ``srun`` step with several tasks: the step's name on this node (job,
    step, restart) and this node's global ranks (``SLURM_GTIDS``); (None, None) otherwise."""
    job, step = environ.get("SLURM_JOB_ID", ""), environ.get("SLURM_STEP_ID", "")
    if task.source != "slurm" or task.world_size < 2 or not (job.isdigit() and step.isdigit()):
        return None, None
    restart = environ.get("SLURM_RESTART_COUNT", "0")
    ranks = None
    gtids = [part.strip() for part in environ.get("SLURM_GTIDS", "").split(",")]
    if gtids and all(part.isdigit() for part in gtids):
        ranks = sorted(int(part) for part in gtids)
    if ranks is None or task.rank not in ranks:
        ranks = list(range(task.local_world_size)) if task.local_world_size > 1 else [task.rank]
    cluster = "".join(ch for ch in environ.get("SLURM_CLUSTER_NAME", "") if ch.isalnum())[:32]
    return f"{cluster or 'slurm'}-{job}.{step}.{restart if restart.isdigit() else 0}", ranks


def torchrun_options(world: World, nprocs: int, request: RunRequest) -> list[str]:
    """torchrun's options for this node (every one spelled out, so no PET_* default applies)."""
    options = ["--nnodes", world.nnodes, "--nproc-per-node", str(nprocs)]
    if world.standalone:
        options.append("--standalone")
    elif world.rdzv_endpoint is not None or (world.rdzv_backend or "static") != "static":
        options += ["--rdzv-backend", world.rdzv_backend or "static"]
        options += ["--rdzv-endpoint", world.rdzv_endpoint or ""]
        if world.node_rank is not None:
            options += ["--node-rank", str(world.node_rank)]
    else:
        options += ["--node-rank", str(world.node_rank or 0),
                    "--master-addr", world.master_addr or "127.0.0.1",
                    "--master-port", str(world.master_port or DEFAULT_PORT)]
    if world.rdzv_id is not None:
        options += ["--rdzv-id", world.rdzv_id]
    if request.max_restarts:
        options += ["--max-restarts", str(request.max_restarts)]
    if request.log_dir:
        # per-rank files under DIR (torchrun's layout), and still on the console
        options += ["--log-dir", request.log_dir, "--tee", "3"]
    return options


def _torchrun_note(world: World, nprocs: int) -> str:
    if world.standalone:
        master = "this host, torchrun's standalone rendezvous on a free port"
    elif world.rdzv_endpoint:
        master = f"rendezvous {world.rdzv_backend or 'static'} at {world.rdzv_endpoint}"
    else:
        master = f"master {world.master_addr or '127.0.0.1'}:{world.master_port or DEFAULT_PORT}"
    node = world.node_rank if world.node_rank is not None else (0 if world.max_nodes == 1 else "?")
    return f"torchrun: {nprocs} process(es) on node {node} of {world.nnodes}, {master}"


def run(request: RunRequest, echo: Callable[[str], None] | None = None) -> int:
    """Plan, say what was chosen (``echo``, stderr by default), run, release; the exit code."""
    echo = echo or (lambda line: print(f"devicekit run: {line}", file=sys.stderr, flush=True))
    if request.command:
        check_command(request.command)  # before leasing: exit 127, not torchrun's traceback
    plan = plan_run(request)
    try:
        for line in plan.notes:
            echo(printable(line))  # notes quote other users' commands
        code = execute(plan)
        if plan.time_limit is not None and plan.time_limit.reached:
            echo(plan.time_limit.message())
        return code
    finally:
        plan.allocation.release()


def rank_variables(task: DistEnv) -> dict[str, str]:
    """torchrun's variables for one rank a launcher started (Slurm / MPI ones marked as such)."""
    values = {
        "RANK": task.rank, "LOCAL_RANK": task.local_rank, "WORLD_SIZE": task.world_size,
        "LOCAL_WORLD_SIZE": task.local_world_size, "GROUP_RANK": task.node_rank,
        "GROUP_WORLD_SIZE": task.nnodes, "ROLE_RANK": task.rank, "ROLE_WORLD_SIZE": task.world_size,
        "MASTER_ADDR": task.master_addr, "MASTER_PORT": task.master_port,
    }
    env = {key: str(value) for key, value in values.items()}
    if task.source in ("slurm", "mpi"):
        # so that dk.dist.env() in the command still reads Slurm / MPI (its device binding)
        env[PUBLISHED_MARKER] = f"{task.source}:{task.rank}:{task.world_size}:{task.master_port}"
    return env


def single_process_variables(port: int) -> dict[str, str]:
    """The variables torchrun sets, for one process on one node (rank 0 of 1)."""
    return {
        "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0",
        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        LAUNCH_MARKER: "1", OWN_DEVICES_ENV: "1",
    }


def _check_torch_can_use(allocation: Allocation) -> None:
    """Refuse to lease real GPUs for a torch that cannot use them (CPU build, driver too old).

    Otherwise the job would hold the GPUs while ``dk.dist.device()`` trains on the CPU.
    Simulated GPUs are exempt: there, the CPU is what the job is expected to use.
    """
    if not allocation.on_gpu or backend().name != "nvml":
        return
    inventory = take_inventory()
    from devicekit.hardware.torch_checks import check_torch_build

    check = check_torch_build(inventory)
    if check.status == "fail":
        raise LaunchError(
            f"{len(allocation.uuids)} GPU(s) leased but torch cannot use them: {check.message};"
            " nothing started (run 'devicekit doctor' for details)"
        )


def _command(command: list[str]) -> list[str]:
    if not command:
        return [sys.executable, "-u", *EXAMPLE_COMMAND]
    if command[0].endswith(".py"):
        return [sys.executable, "-u", *command]
    return list(command)


def _free_port() -> int:
    from devicekit.jobs.launch import free_port

    return free_port()


