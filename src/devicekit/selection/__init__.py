"""Choosing: which devices a request gets, as a straight pipeline.

``select_gpus`` (:mod:`.choose`) runs, once per look: :mod:`.gpu_request` (arguments checked) ->
:mod:`.look` (the machine read once: GPUs, leases, lease directory, policy) ->
:mod:`.candidates` (the filters) -> :mod:`.queue_verdict` (the fair queue's word) -> :mod:`.ranking`
(order, choice, a line for each reject) -> :mod:`.grant` (the lease) -> :class:`.result.Selection`.
Waiting for GPUs shows a progress line (:mod:`.waiting`); ``exclude`` is parsed by :mod:`.exclude`.

May import: ``units``, ``errors``, ``hardware``, ``sharing``; never torch at
module level. Tests: ``tests/selection/`` (``request_path.py`` follows ``devicekit run``'s
request through the files).

Usage::

    import devicekit as dk

    with dk.select_gpus(2, min_free_memory="20GiB") as sel:
        print(sel.cuda_visible_devices, sel.rejected)
"""

from devicekit.selection.candidates import Candidate
from devicekit.selection.choose import select_gpus
from devicekit.selection.gpu_request import FORMATS, ORDERS, Request
from devicekit.selection.result import Selection

__all__ = ["select_gpus", "Selection", "Candidate", "Request", "ORDERS", "FORMATS"]
