"""Split models stay where they were planned: moving one as a whole is refused.

``SplitModel``, ``ModuleSplit`` and ``Pipeline`` hold parts on several devices; ``.to(device)``,
``.cuda()`` or ``.cpu()`` would gather them on one while ``.plan`` still names several, and the
next forward would fail or run elsewhere than printed. A move to where every part already is
passes (frameworks call ``model.to(device)``); dtype casts keep each part on its device.

Usage::

    split = dk.split(model, ["cuda:0", "cuda:1"])
    split.to(torch.bfloat16)       # fine: each part keeps its device
    split.cuda()                   # dk.SplitError: ... split again with the devices you want
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from devicekit.errors import SplitError
from devicekit.modelparallel.partition import Plan

__all__ = ["StaysOnPlan", "SPLIT_ATTR", "refuse_if_split"]

#: set on a model whose units a ModuleSplit holds (its hooks are on), so it is not split twice
SPLIT_ATTR = "_devicekit_split_devices"


def refuse_if_split(model: nn.Module) -> None:
    """Refuse to plan or split a model that is split already (its hooks move inputs as planned)."""
    if getattr(model, SPLIT_ATTR, None) is not None or isinstance(model, StaysOnPlan):
        raise SplitError(f"model {type(model).__name__} is already split; call .unsplit() on the split "
                         "model first, then split it again")


class StaysOnPlan(nn.Module):
    """Refuses to be moved as a whole: its parts live on the devices of ``self.plan``.

    ``.to(device)``, ``.cuda()``, ``.cpu()`` (and the other device moves) would put every part on
    one device while the plan still names several, so the next forward would fail or run
    elsewhere than printed. They are refused with one line, unless every part is already on
    that device (a no-op, as frameworks that call ``model.to(device)`` expect). Casting the
    dtype (``.to(torch.float64)``, ``.half()``) keeps every part on its device and is allowed.
    """

    plan: Plan
    #: how to split it again elsewhere, for the refusal's fix
    split_again = "dk.split(model, [...])"

    def _stay(self, call: str, target: Any) -> None:
        device = torch.device(target) if not isinstance(target, torch.device) else target
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        if all(d == device for d in self.plan.devices):
            return
        where = ", ".join(str(d) for d in self.plan.devices)
        raise SplitError(
            f"{type(self).__name__}{call} would move every part of this split model to {device}, but "
            f"the parts live on [{where}] as planned; inputs may be anywhere, so leave it, or split "
            f"again with the devices you want: {self.split_again}"
        )

    def to(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, int) and not isinstance(target, bool):  # .to(1): a CUDA ordinal
            device: Any = torch.device("cuda", target)
        else:
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            self._stay(".to(...)", device)
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> Any:  # type: ignore[override]
        target = device if isinstance(device, (str, torch.device)) else (
            "cuda" if device is None else torch.device("cuda", device))
        self._stay(".cuda()", target)
        return super().cuda(device)

    def cpu(self) -> Any:  # type: ignore[override]
        self._stay(".cpu()", "cpu")
        return super().cpu()

    def xpu(self, device: Any = None) -> Any:  # type: ignore[override]
        self._stay(".xpu()", "xpu")
        return super().xpu(device)

    def ipu(self, device: Any = None) -> Any:  # type: ignore[override]
        self._stay(".ipu()", "ipu")
        return super().ipu(device)

    def mtia(self, device: Any = None) -> Any:  # type: ignore[override]
        self._stay(".mtia()", "mtia")
        return super().mtia(device)

    def to_empty(self, *, device: Any, recurse: bool = True) -> Any:  # type: ignore[override]
        self._stay(".to_empty(...)", device)
        return super().to_empty(device=device, recurse=recurse)
