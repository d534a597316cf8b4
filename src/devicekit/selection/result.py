"""What selection hands back: :class:`Selection`, the chosen GPUs, their lease and the rejects.

Devices rule: ``Selection.devices`` are ordinals *in this process's view*, resolved when you read
them. Set ``os.environ["CUDA_VISIBLE_DEVICES"] = sel.cuda_visible_devices`` before torch touches
CUDA and they are ``cuda:0..n-1``; leave it alone and they are the chosen GPUs' positions among
the GPUs already visible; if CUDA is already initialised they are matched by UUID.

Usage::

    import devicekit as dk

    with dk.select_gpus(2) as sel:             # a Selection; released on leaving the block
        print(sel.cuda_visible_devices, sel.rejected)
        model = model.to(sel.devices[0])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from devicekit.errors import InvalidValueError
from devicekit.hardware.gpu import GPU
from devicekit.hardware.visible import ORDER_ENV, VISIBLE_ENV, torch_ordinal, visible_value
from devicekit.selection.gpu_request import FORMATS
from devicekit.sharing.leases import Lease

if TYPE_CHECKING:
    import torch

__all__ = ["Selection"]


@dataclass
class Selection:
    """The GPUs chosen by ``select_gpus``, their lease, and why the others were not chosen."""

    gpus: list[GPU]
    rejected: list[str] = field(default_factory=list)
    lease: Lease | None = None
    #: True when too few GPUs were free and ``fallback="cpu"`` gave the CPU instead
    cpu_fallback: bool = False
    #: the fair queue's hold (a time-limited job's running ticket, fair-share bookkeeping),
    #: closed on release
    ticket: Any = None
    #: seconds: the time limit the queue planned this job with (its ticket file's, which its
    #: owner may have changed while waiting); ``devicekit run`` enforces it. None: none
    time_limit: float | None = None

    @property
    def devices(self) -> list[torch.device]:
        """``torch.device``\\ s for the chosen GPUs as *this* process numbers them (see module doc)."""
        import torch

        if self.cpu_fallback:
            return [torch.device("cpu")]
        return [torch.device("cuda", torch_ordinal(gpu)) for gpu in self.gpus]

    @property
    def cuda_visible_devices(self) -> str:
        """Value for ``CUDA_VISIBLE_DEVICES`` naming the chosen GPUs by UUID (``""``: none)."""
        return visible_value(self.gpus, "uuid")

    def visible_devices_value(self, fmt: str = "uuid") -> str:
        """``CUDA_VISIBLE_DEVICES`` value as UUIDs (``"uuid"``) or NVML indices (``"index"``)."""
        if fmt not in FORMATS:
            raise InvalidValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
        mig = [g for g in self.gpus if g.is_mig]
        if fmt == "index" and mig:
            raise InvalidValueError(
                f"format 'index' cannot name {mig[0].label} (a MIG instance has no index in "
                f"{VISIBLE_ENV}); use format 'uuid'")
        return visible_value(self.gpus, fmt)

    def to_env(self, fmt: str = "uuid") -> dict[str, str]:
        """Variables to set for a child so that its ``cuda:0..n-1`` are the chosen GPUs."""
        env = {VISIBLE_ENV: self.visible_devices_value(fmt)}
        if fmt == "index":
            env[ORDER_ENV] = "PCI_BUS_ID"  # NVML indices are PCI bus order
        return env

    def release(self) -> None:
        """Release the lease (if any) and leave the queue. Safe to call twice."""
        if self.lease is not None:
            self.lease.release()
        if self.ticket is not None:
            self.ticket.close()

    def __enter__(self) -> Selection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        what = "cpu" if self.cpu_fallback else ", ".join(g.label for g in self.gpus)
        leased = "leased" if self.lease is not None and not self.lease.released else "not leased"
        return f"Selection([{what}], {leased}, {len(self.rejected)} rejected)"
