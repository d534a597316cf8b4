"""devicekit inside the frameworks people train with: Lightning and the Hugging Face Trainer.

Each callback logs memory per step through the framework's own logger, runs the leak finder over
the first steps (a leak is a :class:`devicekit.LeakWarning` naming the holder, the line and the
fix), writes an out-of-memory bundle (diagnosis, plot, CUDA snapshot) before the error goes on,
and offers devicekit's exact batch-size finder.

Usage::

    from devicekit.integrations.lightning import DeviceKitCallback       # pip install 'devicekit[lightning]'
    trainer = lightning.Trainer(callbacks=[DeviceKitCallback(leak_check_steps=6)])

    from devicekit.integrations.transformers import DeviceKitCallback    # pip install 'devicekit[transformers]'
    trainer = transformers.Trainer(model, args, callbacks=[DeviceKitCallback()])

A front door: it may import any wing, nothing imports it. This package imports neither
framework; each framework module imports only its own.

Modules: ``step_memory`` (figures per step), ``leak_watch`` (leak checks on a schedule),
``oom_bundle`` (the folder an OOM leaves), ``monitor`` (the three together, framework-neutral),
``lightning`` and ``transformers`` (the callbacks).
"""

from __future__ import annotations

__all__: list[str] = []
