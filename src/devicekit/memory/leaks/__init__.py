"""Leak finder: name the variable whose memory keeps growing, the line, and the fix.

Usage::

    import devicekit as dk

    report = dk.find_leaks(train_step, steps=6, warmup=2)     # a step function
    with dk.LeakDetector() as ld:                             # or a loop you write
        for batch in loader:
            ...
            ld.step()
    print(ld.report())
    report.leaks[0].holder, report.leaks[0].lineno, report.to_json()

Part of the ``memory`` wing: imports ``units``, ``errors``, ``hardware``, ``placement``.

Modules: ``holders`` (what to watch by name), ``survivors`` (tensors that outlive their step
by two), ``reach`` (the named path to a survivor), ``discovery`` (survivors to holders),
``measure`` (how big), ``holder_sizes`` (each holder's size, cheaply step after step),
``graphs`` (what an autograd graph keeps, walked once), ``trend`` (is it growing), ``lines``
(which line), ``cycles`` (reference cycles), ``hints`` (what the code around the line does),
``verdict`` (kind, detail and fix), ``judge`` (series to leaks), ``report`` (Leak, LeakReport),
``detector`` (LeakDetector), ``find`` (find_leaks).
"""

from __future__ import annotations

from devicekit.memory.leaks.detector import LeakDetector
from devicekit.memory.leaks.find import find_leaks
from devicekit.memory.leaks.report import KINDS, Leak, LeakReport

__all__ = ["KINDS", "Leak", "LeakDetector", "LeakReport", "find_leaks"]
