"""devicekit.strategy: how to run a job, and whether a parallel set-up computes the right thing.

``advise`` ranks the ways to train a model on the GPUs at hand (one GPU, DDP, FSDP, a split,
offload) from the memory estimate and the model-parallel planner; ``equivalence`` runs one
parallel step beside one single-process step and names the cause when they differ (sum vs
mean, unsynchronised BatchNorm, ...). It sits above both parallel wings and ``jobs``
because it consults all of them.

May import: every wing below (``units`` ... ``memory``, ``parallel``, ``modelparallel``,
``jobs``). Never ``cli`` or ``integrations``.

Usage::

    import devicekit as dk

    advice = dk.advise(model, sample)
    print(advice.best.name, advice.best.fits, advice.best.reason)
    report = dk.check_equivalence(build, batch, loss_fn)   # one DDP step vs one process
"""
