"""``devicekit run``: lease GPUs and run a command (or the bundled example) on them.

Formatting only; the logic is :mod:`devicekit.jobs.run`. torchrun's spellings
(``--nproc_per_node``, ``--max-restarts``, ``--rdzv-*``, ``--standalone``, ``--log-dir``,
``--nnodes MIN:MAX``) are accepted and passed to torchrun; its other options are refused with
a suggestion.

Usage::

    devicekit run                                   # the bundled example on the best device
    devicekit run --gpus 2 -- python train.py       # 2 leased GPUs, torchrun, 2 processes
    devicekit run --gpus 0,2 -- python train.py     # exactly GPUs 0 and 2 (rank 0 on GPU 0)
    devicekit run --procs 2 -- python train.py      # 2 CPU processes with gloo
    devicekit run --name bert-lr3e-4 --gpus 2 -- python train.py   # the job id status shows
    devicekit run --nnodes 2 --node-rank 0 --master-addr node01 -- python train.py
    srun --ntasks-per-node=1 devicekit run --gpus all -- python train.py   # world from Slurm
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Iterator
from typing import Any

import click

from devicekit.cli.filters import (
    WAIT_SECONDS,
    Seconds,
    exclude_option,
    max_util_option,
    parse_exclude,
    parse_max_util,
)

__all__ = ["command"]

#: the torchrun options devicekit run passes on (besides the node and process counts)
PASSED = ("--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port",
          "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--standalone", "--max-restarts",
          "--log-dir")
_ELSEWHERE = {
    "--no-python": "devicekit run starts COMMAND as given (python is added only to a .py file):"
                   " drop --no-python",
    "--no_python": "devicekit run starts COMMAND as given (python is added only to a .py file):"
                   " drop --no_python",
    "-m": "put the module after --: devicekit run -- python -m package.train",
    "--module": "put the module after --: devicekit run -- python -m package.train",
    "--tee": "--log-dir DIR keeps each rank's output in files under DIR and on the console",
    "--redirects": "--log-dir DIR keeps each rank's output in files under DIR and on the console",
}


class _RunCommand(click.Command):
    """Refuses torchrun's options that ``run`` does not pass with a line saying what to do."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            name = exc.option_name.split("=", 1)[0]
            advice = _ELSEWHERE.get(name)
            if advice is None and name.lstrip("-").replace("_", "-") in _TORCHRUN_OPTIONS:
                advice = (f"devicekit run passes {', '.join(PASSED)} to torchrun; for {name} run"
                          " torchrun yourself on GPUs from 'devicekit select'")
            if advice is None:
                raise
            raise click.UsageError(f"{name} is a torchrun option: {advice}", ctx) from None


#: torchrun's other options (its parser, torch.distributed.run), dashes normalised
_TORCHRUN_OPTIONS = frozenset({
    "rdzv-conf", "max-restarts", "monitor-interval", "start-method", "role", "run-path",
    "log-dir", "redirects", "tee", "local-ranks-filter", "node-rank", "local-addr",
    "logs-specs", "numa-binding", "event-log-handler", "signals-to-handle", "virtual-local-rank",
    "duplicate-stdout-filters-to", "duplicate-stderr-filters-to", "use-env", "master-addr",
})


def _gpus(value: str | None) -> tuple[str | None, list[str]]:
    """``--gpus``: a count or 'all' -> (value, []); indices/UUIDs ('0,2', 'GPU-..') -> (None, ids)."""
    if value is None:
        return None, []
    text = value.strip()
    if text.lower() == "all" or text.isdigit():
        return text, []
    ids = [part.strip() for part in text.split(",") if part.strip()]
    if "," not in text and not text.upper().startswith(("GPU-", "MIG-")):
        return text, []  # neither a count nor ids: allocate() names the bad value
    return None, ids


def _procs(value: str | None, gpus: str | None) -> tuple[int | None, str | None]:
    """``--procs``/``--nproc-per-node``: N, or torchrun's 'auto'/'gpu' (one per GPU)."""
    if value is None:
        return None, gpus
    text = value.strip().lower()
    if text in ("auto", "gpu"):
        if gpus is not None:
            raise click.BadParameter(f"{value!r} (one process per GPU) and --gpus {gpus} both"
                                     " say how many; give one", param_hint="'--nproc-per-node'")
        return None, "all"
    if text.isdigit() and int(text) >= 1:
        return int(text), gpus
    hint = " (the number of CPU processes, e.g. --procs 4)" if text == "cpu" else ""
    raise click.BadParameter(f"{value!r} is not a number of processes >= 1, 'auto' or 'gpu'{hint}",
                             param_hint="'--procs'")


@click.command(
    "run", cls=_RunCommand,
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
)
@click.option("--gpus", metavar="N|all|IDS", default=None,
              help="GPUs to lease: a count, 'all', or which ones (indices or UUIDs, e.g. 0,2)"
                   " (default: 1 if there is a GPU, else run on the CPU).")
@click.option("--gpu-ids", "--gpu_ids", "gpu_ids", metavar="IDS", default=None,
              help="Exactly these GPUs (indices or UUIDs, comma-separated); rank 0 gets the first.")
@click.option("--procs", "--nproc-per-node", "--nproc_per_node", "procs", metavar="N|auto",
              default=None, help="Processes per node (CPU processes with gloo where there is no"
                                 " GPU); 'auto'/'gpu': one per GPU.")
@click.option("--gpus-per-proc", type=click.IntRange(min=1), default=None,
              help="GPUs each process drives (model parallel inside data parallel); default"
                   " --gpus / --procs when both are given, else 1.")
@click.option("--min-free", "min_free", metavar="SIZE", default=None,
              help="Only GPUs with at least this much free memory, with a unit, e.g. 20GiB.")
@max_util_option
@exclude_option
@click.option("--wait", type=WAIT_SECONDS, metavar="SECONDS", default=None,
              help="Queue behind busy GPUs for up to this long: a ticket in the fair queue"
                   " (first come, first served; see 'devicekit queue').")
@click.option("--time", "time_limit", metavar="DURATION", default=None,
              help="Time limit (90s, 30m, 2h, 1:30:00): SIGTERM then, SIGKILL after a grace"
                   " period; lets a queued job be backfilled onto GPUs reserved for a bigger one.")
@click.option("--nnodes", metavar="N|MIN:MAX", default=None,
              help="Machines taking part (run the same command on each); default 1, or what the"
                   " launcher devicekit run runs under says.")
@click.option("--node-rank", "--node_rank", "node_rank", type=click.IntRange(min=0), default=None,
              help="This machine's index, 0 to NNODES-1.")
@click.option("--master-addr", "--master_addr", "master_addr", metavar="HOST", default=None,
              help="Host name or IP of node 0 (reachable from every node).")
@click.option("--master-port", "--master_port", "master_port", type=click.IntRange(1, 65535),
              metavar="PORT", default=None,
              help="Port on node 0 for the rendezvous (default 29500 with several nodes).")
@click.option("--rdzv-backend", "--rdzv_backend", "rdzv_backend", metavar="NAME", default=None,
              help="torchrun's rendezvous backend (c10d for elastic jobs).")
@click.option("--rdzv-endpoint", "--rdzv_endpoint", "rdzv_endpoint", metavar="HOST:PORT",
              default=None, help="torchrun's rendezvous endpoint.")
@click.option("--rdzv-id", "--rdzv_id", "rdzv_id", metavar="ID", default=None,
              help="torchrun's rendezvous (job) id, the same on every node.")
@click.option("--standalone", is_flag=True,
              help="torchrun's one-node rendezvous on a free port (the default on one node).")
@click.option("--max-restarts", "--max_restarts", "max_restarts", type=click.IntRange(min=0),
              default=None, help="Let torchrun restart the workers this many times.")
@click.option("--log-dir", "--log_dir", "log_dir", metavar="DIR", default=None,
              help="torchrun writes each rank's stdout/stderr under DIR (and still shows it).")
@click.option("--hang-timeout", "hang_timeout", type=Seconds(0.0), metavar="SECONDS",
              default=600.0, show_default=True,
              help="With several processes: when no rank makes progress this long while one"
                   " waits in a collective, print a report naming the rank to look at and stop"
                   " the job (exit 124); 0: never.")
@click.option("--requeue", is_flag=True,
              help="In a Slurm job: once the ranks have exited after Slurm's warning signal"
                   " (--signal=USR1@90) and rank 0 saved a checkpoint (dk.save_checkpoint),"
                   " run 'scontrol requeue $SLURM_JOB_ID'; dk.resume(DIR) loads it on restart.")
@click.option("--name", "job_name", metavar="NAME", default=None,
              help="The job id its leases carry, shown by status, serve and the lab view"
                   " (1-64 letters, digits or ._:@+=-); default: DEVICEKIT_JOB_ID when set,"
                   " else the Slurm job id inside a Slurm job, else six generated hex digits."
                   " The job's processes get it as"
                   " DEVICEKIT_JOB_ID.")
@click.option("--dry-run", is_flag=True,
              help="Choose the GPUs and print the variables and command line it would start"
                   " (stdout), then release them; start nothing.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def command(gpus: str | None, gpu_ids: str | None, procs: str | None, gpus_per_proc: int | None,
            min_free: str | None, max_util: str | None, exclude: tuple[str, ...],
            wait: float | None, command: tuple[str, ...], dry_run: bool, time_limit: str | None,
            job_name: str | None, **node: Any) -> int:
    """Lease GPUs, set CUDA_VISIBLE_DEVICES and run COMMAND until it exits.

    One process runs COMMAND directly; several processes or nodes run it under torchrun.
    Under srun, mpirun, torchrun or in a Kubeflow pod the job's shape comes from that
    launcher. Without COMMAND the bundled example training runs. The leases are held until
    every process has exited; the exit code is COMMAND's; Ctrl-C stops every process.
    """
    from devicekit.jobs.run import RunRequest, run

    count, ids = _gpus(gpus)
    if gpu_ids is not None:
        if gpus is not None:
            raise click.UsageError("--gpus and --gpu-ids both say which GPUs; give one")
        ids = [part.strip() for part in gpu_ids.split(",") if part.strip()]
    n, count = _procs(procs, count)
    request = RunRequest(
        command=list(command), gpus=count, procs=n, gpus_per_proc=gpus_per_proc,
        min_free_memory=min_free, wait=wait, gpu_ids=ids, exclude=parse_exclude(exclude),
        max_utilization=parse_max_util(max_util), time_limit=time_limit, **node,
    )
    def echo(line: str) -> None:
        click.echo(f"devicekit run: {line}", err=True)

    with _job_id(job_name):
        if not dry_run:
            return run(request, echo=echo)
        return _dry_run(request, echo)


@contextlib.contextmanager
def _job_id(name: str | None) -> Iterator[None]:
    """``DEVICEKIT_JOB_ID`` set to the job's id while it runs (the leases and every process of
    the job read it), then put back as it was."""
    from devicekit.sharing.lease_records import JOB_ENV, check_job_name
    from devicekit.sharing.leases import default_job

    if name is not None:
        try:
            check_job_name(name)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="'--name'") from None
    previous = os.environ.get(JOB_ENV)
    os.environ[JOB_ENV] = name if name is not None else default_job()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(JOB_ENV, None)
        else:
            os.environ[JOB_ENV] = previous


def _dry_run(request: Any, echo: Any) -> int:
    from devicekit.jobs.run import plan_run

    plan = plan_run(request)
    try:
        for line in plan.notes:
            echo(line)
        for key in sorted(plan.env):
            if os.environ.get(key) != plan.env[key]:
                click.echo(f"{key}={shlex.quote(plan.env[key])}")
        click.echo(shlex.join(plan.argv))
        echo("--dry-run: nothing started" + ("; the leases are released" if plan.allocation.on_gpu else ""))
    finally:
        plan.allocation.release()
    return 0
