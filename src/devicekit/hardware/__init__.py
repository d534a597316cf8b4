"""What exists: GPU inventory (NVML or simulated), MIG, host facts, device ordering, capability,
the launcher this process runs under (:mod:`.launchers`: torchrun, Slurm, MPI, read once) and
Slurm's view of this node (:mod:`.slurm_node`).

Facts only: who holds a GPU and who is next lives one floor up in :mod:`devicekit.sharing`,
choosing GPUs for a request in :mod:`devicekit.selection`. Nothing in this package imports torch
at module level, so ``devicekit status`` and ``select`` start fast and work where torch is broken.

May import: ``units``, ``errors``; never torch at module level, never another
wing. Entry points: ``dk.gpus()`` (:mod:`.inventory`), ``dk.host()`` (:mod:`.host`),
``visible_devices()`` (:mod:`.visible`), ``capabilities()`` (:mod:`.capability`),
``detect_environment()`` (:mod:`.launchers`, behind ``dk.dist.env()``).
Tests: ``tests/hardware/`` (one ``test_<module>.py`` per module where it has its own).

Usage::

    import devicekit as dk

    print([g.name for g in dk.gpus()])
    print(dk.host().usable_cpus)
"""
