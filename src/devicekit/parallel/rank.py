"""This rank's training device, and whether it is one of several ranks.

Used by DDP set-up (:mod:`devicekit.parallel.ddp`), weighted loaders and equivalence checks;
it lives apart from them so that none imports another for it.

Usage::

    from devicekit.parallel.rank import is_distributed, rank_device

    device = rank_device()        # cuda:<this rank's GPU>, mps, or cpu
    if is_distributed(): ...
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["is_distributed", "rank_device"]


def is_distributed() -> bool:
    """True when a default process group exists and has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_device() -> torch.device:
    """The device this process trains on.

    With an NCCL process group (``dk.dist.init`` / ``dk.launch`` on GPUs): the current CUDA
    device, which ``init`` set from the rank's leased GPU; if it was never set (still
    ``cuda:0``) while torchrun's ``LOCAL_RANK`` (times ``DEVICEKIT_GPUS_PER_PROC``) names
    another visible GPU, that GPU; a ``dk.launch`` rank, which sees only its own GPU(s), stays
    on ``cuda:0``. With a
    gloo-only group: the CPU
    (devicekit uses gloo only where there is no GPU; pass ``device=`` to ``ddp`` to override).
    Without a process group: the current CUDA device, else MPS, else the CPU.
    """
    if dist.is_available() and dist.is_initialized():
        if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
            from devicekit.parallel.dist import OWN_DEVICES_ENV, _gpus_per_proc

            current = torch.cuda.current_device()
            local_rank = os.environ.get("LOCAL_RANK", "")
            # dk.launch / devicekit run with one process: the rank sees only its own GPU(s),
            # the first of which is cuda:0 even when it has several (gpus_per_proc)
            own = os.environ.get(OWN_DEVICES_ENV) == "1"
            if current == 0 and not own and local_rank.isdigit():
                # torchrun with every GPU visible and no torch.cuda.set_device(local_rank) yet:
                # staying on cuda:0 would put every rank on the same GPU; with
                # DEVICEKIT_GPUS_PER_PROC=G the rank's first GPU is local_rank * G
                first = int(local_rank) * _gpus_per_proc()
                if 0 < first < torch.cuda.device_count():
                    return torch.device("cuda", first)
            return torch.device("cuda", current)
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")
