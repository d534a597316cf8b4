"""Lower precision done the way the seeds advise: norm layers stay fp32, fp16 gets a scaler.

``half(model)`` converts a model to fp16 (or bf16) in place but keeps normalisation layers
(BatchNorm, LayerNorm, GroupNorm by default) in fp32: a forward pre-hook casts their inputs to
fp32 and a forward hook casts their outputs back, so the model runs end to end. Floating inputs
to the model are cast to the model's dtype too (``cast_inputs=False`` turns that off).

``mixed_precision(device)`` picks the autocast dtype (bf16 where the device supports it, fp16
otherwise on CUDA; bf16 on CPU) and gives a ``GradScaler`` only for fp16; otherwise a disabled
scaler with the same API, so one training loop serves both.

Usage::

    import devicekit as dk

    model = dk.half(model, dtype=torch.bfloat16)   # BatchNorm stays fp32
    out = model(images)                            # images cast to bf16 on the way in

    amp = dk.mixed_precision("cuda")
    with amp.autocast():
        loss = loss_fn(model(x), y)
    amp.backward_step(loss, optimizer)             # scale, step, update (no-op scaler for bf16)
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from devicekit.errors import InvalidValueError
from devicekit.placement.devices import DeviceLike, as_device

__all__ = ["half", "mixed_precision", "MixedPrecision", "NORM_LAYERS"]

M = TypeVar("M", bound=nn.Module)

#: The layers ``half`` keeps in fp32 unless told otherwise.
NORM_LAYERS: tuple[type[nn.Module], ...] = (_BatchNorm, nn.LayerNorm, nn.GroupNorm)
_HOOKS_ATTR = "_devicekit_precision_hooks"


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating tensors (also inside tuples/lists/dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_cast_floating(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast_floating(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value


def _convert_own_tensors(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the module's own floating parameters, their grads, and buffers (not its children)."""
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype)
            if param.grad is not None:
                param.grad.data = param.grad.data.to(dtype)
    for name, buffer in module.named_buffers(recurse=False):
        if buffer is not None and buffer.is_floating_point():
            setattr(module, name, buffer.to(dtype))


def _kept(module: nn.Module, keep: tuple[type[nn.Module], ...]) -> bool:
    return bool(keep) and isinstance(module, keep)


def _check_keep(keep_fp32: Iterable[type[nn.Module]] | type[nn.Module] | None) -> tuple[type[nn.Module], ...]:
    if keep_fp32 is None:
        return ()
    classes = (keep_fp32,) if isinstance(keep_fp32, type) else tuple(keep_fp32)
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise InvalidValueError(
                f"keep_fp32 entry {cls!r} is not an nn.Module class; pass classes such as nn.BatchNorm2d"
            )
    return classes


def half(
    model: M,
    dtype: torch.dtype = torch.float16,
    keep_fp32: Iterable[type[nn.Module]] | type[nn.Module] | None = NORM_LAYERS,
    *,
    cast_inputs: bool = True,
) -> M:
    """Convert ``model`` in place to ``dtype`` except the ``keep_fp32`` layers; returns it.

    Kept layers (and everything inside them) stay fp32; their floating inputs are cast to fp32
    and their floating outputs back to ``dtype``. Calling ``half`` again replaces the hooks.
    """
    if not isinstance(model, nn.Module):
        raise InvalidValueError(f"half() needs an nn.Module, got {type(model).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidValueError(f"dtype {dtype!r} is not a floating dtype; use torch.float16 or torch.bfloat16")
    keep = _check_keep(keep_fp32)
    for handle in getattr(model, _HOOKS_ATTR, ()):
        handle.remove()
    handles: list[Any] = []

    def to_fp32(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return _cast_floating(args, torch.float32)

    def back_to_dtype(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        return _cast_floating(output, dtype)

    def inputs_to_dtype(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return _cast_floating(args, dtype)

    stack: list[nn.Module] = [model]
    seen: set[int] = set()
    while stack:
        module = stack.pop()
        if id(module) in seen:  # a submodule shared by two parents is converted once
            continue
        seen.add(id(module))
        if _kept(module, keep):
            module.float()
            handles.append(module.register_forward_pre_hook(to_fp32))
            handles.append(module.register_forward_hook(back_to_dtype))
            continue  # a kept layer's children stay fp32 with it
        _convert_own_tensors(module, dtype)
        stack.extend(module.children())
    if cast_inputs and not _kept(model, keep):
        handles.append(model.register_forward_pre_hook(inputs_to_dtype))
    object.__setattr__(model, _HOOKS_ATTR, handles)
    return model


class MixedPrecision:
    """What ``mixed_precision`` returns: ``dtype``, ``autocast()``, ``scaler``, ``backward_step``.

    Also a context manager itself: ``with amp: ...`` is ``with amp.autocast(): ...``.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype, use_scaler: bool) -> None:
        self.device = device
        self.dtype = dtype
        self.uses_scaler = use_scaler
        try:
            self.scaler: torch.amp.GradScaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
        except (RuntimeError, ValueError, AssertionError) as err:
            raise InvalidValueError(
                f"torch has no GradScaler for {device.type!r} ({err}); pass dtype=torch.bfloat16"
            ) from None
        self._active: list[AbstractContextManager[Any]] = []

    def autocast(self, enabled: bool = True) -> torch.autocast:
        """The autocast context for this device and dtype."""
        return torch.autocast(device_type=self.device.type, dtype=self.dtype, enabled=enabled)

    def backward_step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """``loss.backward()`` then ``optimizer.step()``, through the scaler when fp16 needs one."""
        self.scaler.scale(loss).backward()
        self.scaler.step(optimizer)
        self.scaler.update()

    def __enter__(self) -> MixedPrecision:
        context = self.autocast()
        context.__enter__()
        self._active.append(context)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active.pop().__exit__(*exc)

    def __repr__(self) -> str:
        scaler = "GradScaler" if self.uses_scaler else "no scaler"
        return f"MixedPrecision(device={self.device}, dtype={self.dtype}, {scaler})"


def _bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return True
    return False


def mixed_precision(device: DeviceLike, dtype: torch.dtype | None = None) -> MixedPrecision:
    """Autocast settings for ``device``: bf16 where supported, else fp16 with a GradScaler.

    ``dtype`` forces ``torch.float16`` or ``torch.bfloat16``.
    """
    target = as_device(device)
    if not torch.amp.is_autocast_available(target.type):
        raise InvalidValueError(f"device {str(target)!r} has no autocast support; use 'cuda' or 'cpu'")
    if dtype is None:
        dtype = torch.bfloat16 if _bf16_supported(target) else torch.float16
    elif dtype not in (torch.float16, torch.bfloat16):
        raise InvalidValueError(f"mixed precision dtype {dtype!r} is not torch.float16 or torch.bfloat16")
    use_scaler = dtype == torch.float16
    return MixedPrecision(target, dtype, use_scaler)
