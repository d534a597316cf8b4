"""``devicekit advise MODULE:FACTORY --input SHAPE``: which strategy, on the GPUs that exist.

Usage::

    devicekit advise mypkg.models:build_lm --input 512:long --batch 8
    devicekit --simulate four-small-gpus.json advise mypkg.models:build_lm --input 512:long --json
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
def command(model_spec: str, inputs: str, batch: int, optimizer: str, precision: str | None,
            loss: str | None, step_spec: str | None, as_json: bool) -> None:
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
    click.echo(json.dumps(advice.to_dict(), indent=2) if as_json else str(advice))
