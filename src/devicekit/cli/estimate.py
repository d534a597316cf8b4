"""``devicekit estimate MODULE:FACTORY --input SHAPE``: the memory of one step, before running.

Usage::

    devicekit estimate mypkg.models:build_resnet --input 3x224x224 --batch 64
    devicekit estimate mypkg.models:build_lm --input 512:long --batch 8 --precision bf16 --json
    devicekit estimate mypkg.models:build_lm --input 512:long --loss cross-entropy
    devicekit estimate mypkg.models:build_lm --input 512:long --step mytrain:step
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

from devicekit.cli.model_factory import check_model_args
from devicekit.cli.phases import PhaseStatus
from devicekit.units import format_size

__all__ = ["checked_step_options", "command", "model_options", "where_time_went"]


def model_options(fn: click.decorators.FC) -> click.decorators.FC:
    """The options estimate and advise share."""
    for decorator in reversed([
        click.argument("model_spec", metavar="MODULE:FACTORY"),
        click.option("--input", "inputs", required=True, metavar="SHAPE[,SHAPE...]",
                     help="One sample's shape without the batch, e.g. 3x224x224 or 512:long."),
        click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Batch size (the first dimension)."),
        click.option("--optimizer", default="adam", show_default=True,
                     help="adam, adamw, sgd, sgd-momentum (or momentum), rmsprop, adagrad, adafactor, "
                          "adadelta, adamax, nadam, radam, sparse-adam or none."),
        click.option("--precision", default=None, help="bf16 or fp16 (autocast); default fp32."),
        click.option("--loss", default=None, metavar="cross-entropy|mse|sum",
                     help="The loss your loop computes; default: cross-entropy (assumed)."),
        click.option("--step", "step_spec", default=None, metavar="MODULE:FN",
                     help="Your own step: FN(model, sample) runs forward, loss and backward()."),
        click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table."),
    ]):
        fn = decorator(fn)
    return fn


@click.command(help="Estimate the peak memory of one training step of a model, before running it.")
@model_options
@click.option("--inference", is_flag=True,
              help="Size an eval loop instead: out = model(x) under no_grad (or your --step).")
def command(model_spec: str, inputs: str, batch: int, optimizer: str, precision: str | None,
            loss: str | None, step_spec: str | None, as_json: bool, inference: bool) -> None:
    started = time.perf_counter()
    if inference:
        _refuse_training_options(optimizer, loss, step_spec)
    kwargs = checked_step_options(optimizer, precision, loss, step_spec)
    check_model_args(model_spec, inputs)
    with PhaseStatus("estimate") as status:
        status.phase("importing torch and devicekit")
        import torch._dynamo  # noqa: F401  (fake tensors import it on first use: count it as import time)

        from devicekit.cli.model_factory import load_factory, parse_inputs
        from devicekit.memory.estimate import estimate_memory

        spent = {"importing torch and devicekit": time.perf_counter() - started}
        status.phase(f"building the model ({model_spec})")
        sample = parse_inputs(inputs, batch)
        model = load_factory(model_spec)
        spent["building the model"] = time.perf_counter() - started - sum(spent.values())
        status.phase("estimating: one " + ("forward" if inference else "training step") + " on fake tensors")
        est = estimate_memory(model, sample, training=not inference, **kwargs)
    spent.update(est.timings)
    if as_json:
        click.echo(json.dumps(est.to_dict(), indent=2))
        return
    click.echo(str(est))
    what = "what nvidia-smi shows, at most" if est.device.type == "cuda" else "bytes allocated at the peak"
    click.echo(f"  (estimated in {est.seconds:.2f} s; {format_size(est.high or est.peak)}: {what})")
    total = time.perf_counter() - started
    if total > SLOW_SECONDS:
        click.echo(f"  {total:.1f} s in all: {where_time_went(spent)}")


#: past this many seconds the command says where its time went
SLOW_SECONDS = 10.0


def where_time_went(spent: dict[str, float]) -> str:
    """One line: each stage's seconds, largest first, and what makes the largest slow."""
    stages = sorted(spent.items(), key=lambda item: -item[1])
    line = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in stages if seconds >= 0.05)
    why = {
        "fake-tensor step": "each op of one step runs once on fake tensors, in Python (about "
                            "0.1 ms for an op with shapes not yet seen, a fraction of that for a "
                            "repeat): a step of many ops costs most, as RNN layers run several "
                            "per time step of a long sequence; the first estimate in a process "
                            "also warms torch",
        "real CPU steps": "fake tensors could not run the model, so real steps ran at two "
                          "smaller batches (see 'sized by')",
        "importing torch and devicekit": "torch's import, done once per process",
    }.get(stages[0][0], "")
    return f"{line} ({why})" if why else line


def _refuse_training_options(optimizer: str, loss: str | None, step_spec: str | None) -> None:
    """--inference sizes a forward pass: an --optimizer or --loss given with it would be
    ignored, so it is refused instead (a --step is the eval loop's own step: it is run)."""
    from devicekit.errors import InvalidValueError

    given = click.get_current_context().get_parameter_source("optimizer")
    for flag, value in (("--optimizer", optimizer if given == click.core.ParameterSource.COMMANDLINE else None),
                        ("--loss", loss)):
        if value is not None:
            raise InvalidValueError(f"{flag} {value}: --inference sizes a forward pass, which has no "
                                    f"{flag.removeprefix('--')}; leave out one of the two")


def checked_step_options(optimizer: str, precision: str | None, loss: str | None,
                         step_spec: str | None) -> dict[str, Any]:
    """The step's keyword arguments from the flags, each checked before torch is imported."""
    from devicekit.errors import InvalidValueError
    from devicekit.memory.step_names import check_step_names

    check_step_names(optimizer=optimizer, precision=precision, loss=loss)
    if step_spec is not None and loss is not None:
        raise InvalidValueError(f"--step {step_spec} computes its own loss; leave out --loss {loss}")
    if step_spec is not None and ":" not in step_spec:
        raise InvalidValueError(f"step {step_spec!r} is not MODULE:FN, e.g. mytrain:step")
    kwargs: dict[str, Any] = {"optimizer": None if optimizer.lower() == "none" else optimizer,
                              "precision": precision, "loss_fn": loss}
    if step_spec is not None:
        from devicekit.cli.model_factory import load_function

        kwargs["step"] = load_function(step_spec, "step", "MODULE:FN")
    return kwargs
