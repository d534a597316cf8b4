"""What exists: GPU inventory (NVML or simulated), MIG, host facts, device ordering, capability,
the launcher this process runs under (:mod:`.launchers`: torchrun, Slurm, MPI, read once) and
Slurm's view of this node (:mod:`.slurm_node`).

Facts only: who holds a GPU and who is next lives one floor up in :mod:`devicekit.sharing`,
choosing GPUs for a request in :mod:`devicekit.selection`. Nothing in this package imports torch
at module level, so ``devicekit status`` and ``select`` start fast and work where torch is broken.

May import: ``units``, ``errors`` (and ``moved``); never torch at module level, never another
wing. Entry points: ``dk.gpus()`` (:mod:`.inventory`), ``dk.host()`` (:mod:`.host`),
``visible_devices()`` (:mod:`.visible`), ``capabilities()`` (:mod:`.capability`),
``detect_environment()`` (:mod:`.launchers`, behind ``dk.dist.env()``).
Tests: ``tests/hardware/`` (one ``test_<module>.py`` per module where it has its own).

Usage::

    import devicekit as dk

    print([g.name for g in dk.gpus()])
    print(dk.host().usable_cpus)
"""

from devicekit.moved import alias_modules

# moved out when the sharing wing was split off (old paths work for one release, with a warning)
alias_modules("devicekit.hardware", {
    **{name: f"devicekit.sharing.{name}" for name in (
        "lease_directory", "device_locks", "live_holder", "lease_records", "leases",
        "lock_squatting", "stopped_jobs", "tickets", "queue_order", "queue_state", "queue_turn",
        "policy", "fair_share")},
    "status": "devicekit.sharing.machine_status",
    "table": "devicekit.sharing.status_table",
    "checks": "devicekit.sharing.doctor_checks",
    "check": "devicekit.hardware.check_result",
    "selection": "devicekit.selection",
    "waiting": "devicekit.selection.waiting",
    "exclude": "devicekit.selection.exclude",
})
