"""``devicekit run``: lease GPUs and run a command (or the bundled example) on them.

Formatting only; the logic is :mod:`devicekit.parallel.run`.

Usage::

    devicekit run                                   # the bundled example on the best device
    devicekit run --gpus 2 -- python train.py       # 2 leased GPUs, torchrun, 2 processes
    devicekit run --procs 2 -- python train.py      # 2 CPU processes with gloo
    devicekit run --nnodes 2 --node-rank 0 --master-addr node01 -- python train.py
"""

from __future__ import annotations

import click

__all__ = ["command"]


@click.command(
    "run",
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
)
@click.option("--gpus", metavar="N|all", default=None,
              help="GPUs to lease (default: 1 if there is a GPU, else run on the CPU).")
@click.option("--procs", type=click.IntRange(min=1), default=None,
              help="Processes per node (CPU processes with gloo where there is no GPU).")
@click.option("--gpus-per-proc", type=click.IntRange(min=1), default=1, show_default=True,
              help="GPUs each process drives (model parallel inside data parallel).")
@click.option("--min-free", "min_free", metavar="SIZE", default=None,
              help="Only GPUs with at least this much free memory, with a unit, e.g. 20GiB.")
@click.option("--wait", type=click.FloatRange(min=0), metavar="SECONDS", default=None,
              help="Queue behind busy GPUs for up to this long (with progress).")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Machines taking part (run the same command on each).")
@click.option("--node-rank", type=click.IntRange(min=0), default=None,
              help="This machine's index, 0 to NNODES-1.")
@click.option("--master-addr", metavar="HOST", default=None,
              help="Host name or IP of node 0 (reachable from every node).")
@click.option("--master-port", type=click.IntRange(1, 65535), metavar="PORT", default=None,
              help="Port on node 0 for the rendezvous (default 29500 with several nodes).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def command(
    gpus: str | None,
    procs: int | None,
    gpus_per_proc: int,
    min_free: str | None,
    wait: float | None,
    nnodes: int,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    command: tuple[str, ...],
) -> int:
    """Lease GPUs, set CUDA_VISIBLE_DEVICES and run COMMAND until it exits.

    One process runs COMMAND directly; several processes or nodes run it under torchrun.
    Without COMMAND the bundled example training runs. The leases are held until every
    process has exited; the exit code is COMMAND's; Ctrl-C stops every process.
    """
    from devicekit.parallel.run import RunRequest, run

    request = RunRequest(
        command=list(command),
        gpus=gpus,
        procs=procs,
        gpus_per_proc=gpus_per_proc,
        min_free_memory=min_free,
        wait=wait,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
    )
    return run(request, echo=lambda line: click.echo(f"devicekit run: {line}", err=True))
