"""devicekit.placement: where tensors and modules live, moving them, checkpoints, precision.

One concept per module:

- ``devices``: ``try_gpu``, ``try_all_gpus``, ``as_device`` (checked device specs)
- ``transfer``: ``to_device``, ``pin_memory``, ``device_of`` for whole batches
- ``prefetch``: ``Prefetcher``, next batch copied on a side CUDA stream
- ``checkpoint``: atomic ``save_checkpoint``, device-mapping ``load_checkpoint``
- ``resume``: ``latest_checkpoint``, ``resume`` (the newest readable checkpoint, after a requeue)
- ``preemption``: ``preempted``, ``on_preempt`` (Slurm's warning signal as a flag in a rank)
- ``precision``: ``half`` (norm layers kept fp32), ``mixed_precision``
- ``modes``: ``performance_mode``, ``deterministic_mode`` (undoable)
- ``metric_log``: ``RunningMean``, ``MetricLog`` kept on the device
- ``sync_guard``: find hidden host synchronisations

May import: ``units``, ``errors``, ``hardware`` (and torch).

Usage::

    import devicekit as dk

    device = dk.try_gpu()
    model = dk.to_device(model, device)
    for batch in dk.Prefetcher(loader, device):
        ...
    dk.save_checkpoint(model.state_dict(), "last.pt")
"""
