"""devicekit.parallel: what runs inside a rank of a data-parallel job.

The wing a training script calls once its process exists: the process group and this rank's
device (``dist``, ``rank``; the launcher variables are read by
:mod:`devicekit.hardware.launchers`), DDP set-up, samplers, epochs, uneven
inputs and checkpoints (``ddp``), weighted data for mixed GPUs (``weighted_loader``,
``weighted_split``), single-process DataParallel without the device-0 hotspot
(``balanced_dp``), FSDP2 sharding per block (``shard``, ``blocks``). Starting and supervising
the processes is :mod:`devicekit.jobs`, one floor up.

May import: ``units``, ``errors``, ``hardware``, ``placement`` (and torch). Never ``jobs``,
``strategy``, ``cli`` or ``integrations``. Tests: ``tests/parallel/`` (``boot/`` in
``test_boot_hook.py``).

Usage::

    import devicekit as dk

    device = dk.dist.init()                       # torchrun, srun, mpirun, dk.launch or plain python
    model = dk.ddp(net)                           # right device_ids; unwrapped in one process
    loader = dk.distributed_loader(dataset, batch_size=32)
    for epoch in dk.epochs(loader, 10):
        for x, y in loader: ...
"""
