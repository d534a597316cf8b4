"""What exists and who may use it: GPU inventory, host facts, device ordering, leases, selection.

Nothing in this package imports torch at module level, so ``devicekit status`` and ``select``
start fast and work where torch is broken.

May import: ``units``, ``errors`` (and ``moved``); never torch at module level, never another
wing. Entry points: ``dk.gpus()``, ``dk.host()``, ``dk.select_gpus()``, ``collect_status()``
(:mod:`.status`), ``run_checks()`` (:mod:`.checks`, ``devicekit doctor``).

Usage::

    import devicekit as dk

    print([g.name for g in dk.gpus()])
    with dk.select_gpus(2, min_free_memory="20GiB") as sel:
        print(sel.cuda_visible_devices)
"""
