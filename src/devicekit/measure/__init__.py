"""How fast each device is: the measurements behind ``dk.bench()`` and ``devicekit bench``.

(Named ``measure`` so that the package does not shadow the function ``devicekit.bench``.)

Measures matmul throughput per dtype and size, copy bandwidths (host <-> device, within a
device, GPU to GPU), launch latency, D2L's logging and multi-GPU exercises, and puts each figure
beside the device's datasheet peak (:mod:`devicekit.hardware.known_gpus`). Results are cached
per GPU UUID for the capability score (:mod:`devicekit.hardware.capability`).

May import: ``units``, ``errors``, ``hardware``, ``placement`` (and torch).

Usage::

    import devicekit as dk

    report = dk.bench(quick=True)
    for dev in report.devices:
        print(dev.device, dev.best("matmul.").value, "TFLOP/s")
"""

from devicekit.measure.bench_runner import bench
from devicekit.measure.report import BenchReport, DeviceBench, Figure

__all__ = ["bench", "BenchReport", "DeviceBench", "Figure"]
