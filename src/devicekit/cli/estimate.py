"""``devicekit estimate MODULE:FACTORY --input SHAPE``: the memory of one step, before running.

Usage::

    devicekit estimate mypkg.models:build_resnet --input 3x224x224 --batch 64
    devicekit estimate mypkg.models:build_lm --input 512:long --batch 8 --precision bf16 --json
"""

from __future__ import annotations

import json

import click

from devicekit.units import format_size

__all__ = ["command", "model_options"]


def model_options(fn: click.decorators.FC) -> click.decorators.FC:
    """The options estimate and advise share."""
    for decorator in reversed([
        click.argument("model_spec", metavar="MODULE:FACTORY"),
        click.option("--input", "inputs", required=True, metavar="SHAPE[,SHAPE...]",
                     help="One sample's shape without the batch, e.g. 3x224x224 or 512:long."),
        click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Batch size (the first dimension)."),
        click.option("--optimizer", default="adam", show_default=True,
                     help="adam, adamw, sgd, sgd-momentum, rmsprop, adagrad or none."),
        click.option("--precision", default=None, help="bf16 or fp16 (autocast); default fp32."),
        click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table."),
    ]):
        fn = decorator(fn)
    return fn


@click.command(help="Estimate the peak memory of one training step of a model, before running it.")
@model_options
@click.option("--inference", is_flag=True, help="Size a forward pass without gradients instead.")
def command(model_spec: str, inputs: str, batch: int, optimizer: str, precision: str | None,
            as_json: bool, inference: bool) -> None:
    from devicekit.cli.model_factory import load_factory, parse_inputs
    from devicekit.memory.estimate import estimate_memory

    sample = parse_inputs(inputs, batch)
    model = load_factory(model_spec)
    est = estimate_memory(model, sample, optimizer=None if optimizer.lower() == "none" else optimizer,
                          precision=precision, training=not inference)
    if as_json:
        click.echo(json.dumps(est.to_dict(), indent=2))
        return
    click.echo(str(est))
    click.echo(f"  (estimated in {est.seconds:.2f} s on fake tensors; {format_size(est.peak)} is the "
               "peak the caching allocator hands out)")
