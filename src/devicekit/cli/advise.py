"""``devicekit advise MODULE:FACTORY --input SHAPE``: which strategy, on the GPUs that exist.

Usage::

    devicekit advise mypkg.models:build_lm --input 512:long --batch 8
    devicekit --simulate four-small-gpus.json advise mypkg.models:build_lm --input 512:long --json
    devicekit advise mypkg.models:build_lm --input 512:long --sbatch --time 02:00:00 > job.sh
"""

from __future__ import annotations

import json

import click

from devicekit.cli.estimate import checked_step_options, model_options
from devicekit.cli.model_factory import check_model_args
from devicekit.cli.phases import PhaseStatus

__all__ = ["command"]


@click.command(help="Rank strategies (one GPU, DDP, FSDP, split, offload) for a model on these GPUs.")
@model_options
@click.option("--sbatch", is_flag=True,
              help="Print an sbatch job script for the best strategy instead (one node, --gres,"
                   " --ntasks-per-node, --cpus-per-task, --time, --signal=USR1@90).")
@click.option("--time", "time_limit", default=None, metavar="LIMIT",
              help="With --sbatch: the job's time limit (MINUTES, HH:MM:SS or DAYS-HH:MM:SS);"
                   " default 01:00:00.")
def command(model_spec: str, inputs: str, batch: int, optimizer: str, precision: str | None,
            loss: str | None, step_spec: str | None, as_json: bool, sbatch: bool,
            time_limit: str | None) -> None:
    from devicekit.strategy.sbatch import check_time

    if time_limit is not None and not sbatch:
        raise click.UsageError("--time is the sbatch script's time limit: use it with --sbatch")
    limit = check_time(time_limit or "01:00:00")
    kwargs = checked_step_options(optimizer, precision, loss, step_spec)
    check_model_args(model_spec, inputs)
    with PhaseStatus("advise") as status:
        status.phase("importing torch and devicekit")
        from devicekit.cli.model_factory import load_factory, parse_inputs
        from devicekit.strategy.advise import advise

        status.phase(f"building the model ({model_spec})")
        sample = parse_inputs(inputs, batch)
        model = load_factory(model_spec)
        status.phase("estimating the step and ranking strategies for these GPUs")
        advice = advise(model, sample, **kwargs)
    if sbatch:
        from devicekit.jobs.threads import usable_cores
        from devicekit.strategy.sbatch import sbatch_script

        script = sbatch_script(advice, time=limit, cores=usable_cores())
        click.echo(json.dumps({**advice.to_dict(), "sbatch": script}, indent=2) if as_json
                   else script, nl=as_json)
        return
    click.echo(json.dumps(advice.to_dict(), indent=2) if as_json else str(advice))
