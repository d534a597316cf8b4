"""One model over several devices: plan it, split it, pipeline it.

Usage::

    import torch
    import devicekit as dk

    with torch.device("meta"):
        model = build_model()                              # any nn.Module, nn.Sequential too
    plan = dk.plan_devices(model, {0: "20GiB", 1: "20GiB", "cpu": "64GiB"},
                           sample=torch.empty(8, 512, dtype=torch.long, device="meta"))
    print(plan)                                            # parts, memory, budgets, ties, reasons
    split = dk.split(build_model(), plan)                  # placed unit by unit; runs as the model
    pipe = dk.Pipeline(build_model(), ["cuda:0", "cuda:1"], chunks=8)   # micro-batches overlap

What this wing is: model parallelism inside one process (and, with ``pipeline_stage``, one
stage per process). Entry points, re-exported as ``dk.*``:

* ``split`` (:mod:`.split`): any model over a device list or a plan; one path for every model,
  an ``nn.Sequential`` included (its split is a ``SplitModel``, a ``ModuleSplit``).
* ``plan_devices`` (:mod:`.plan`): how many devices, which units where, within memory budgets.
* ``Pipeline`` (:mod:`.pipeline`) and ``pipeline_stage`` (:mod:`.stages`): GPipe micro-batches
  over a chain of consecutive parts, in threads or across processes.
* ``Plan`` (:mod:`.partition`) and ``DeferredBatchNorm`` (:mod:`.batchnorm`).
* ``Call`` (:mod:`.call_args`, importable from this package): a sample of positional and keyword
  arguments, ``sample=Call(x, mask=m)``; a dict of the forward's argument names is keywords too.

One concept per file, in layers (each imports only those below it):

* front: ``split``, ``plan``, ``pipeline``, ``stages``;
* planning and placing: ``module_split`` (hooks place units), ``module_plan`` (units within
  budgets), ``budget_fit`` (fewest GPUs, CPU offload), ``unit_plan`` (measure and group tied
  units), ``layer_plan`` (consecutive parts for a pipeline), ``chain`` (trace a model into
  stages), ``blocks`` (stages at a model's block boundaries, for a forward run as it is);
* the pipeline's two engines, one call each, behind ``Pipeline``: ``chain_pipeline`` (a chain of
  parts) and ``block_pipeline`` (a forward run as it is, cut by hooks); both run micro-batches
  on ``microbatch_threads`` (the one thread pool: turnstiles, backward order, random draws);
* pieces: ``module_units``, ``layer_profile``, ``sharing``, ``partition``, ``balance``,
  ``device_flow``, ``copy_streams``, ``recompute``, ``microbatch``, ``schedule``,
  ``batchnorm``, ``stays``, ``device_list``, ``call_args``, ``output_join``, ``state_guard``.

What it imports: ``placement`` (devices, moving nested tensors), ``hardware`` (the inventory,
for default budgets; imported inside the function that needs it), ``units`` and ``errors``.
It shares its floor with ``parallel`` and may import the floors below (tests/test_house.py):
never ``jobs``, ``strategy`` or a front door, which are the wings that may import it.
"""

from devicekit.modelparallel.call_args import Call

__all__ = ["Call"]
