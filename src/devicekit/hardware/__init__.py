"""What exists and who may use it: GPU inventory, host facts, device ordering, leases, selection.

Nothing in this package imports torch at module level, so ``devicekit status`` and ``select``
start fast and work where torch is broken.

Usage::

    import devicekit as dk

    print([g.name for g in dk.gpus()])
    with dk.select_gpus(2, min_free_memory="20GiB") as sel:
        print(sel.cuda_visible_devices)
"""
