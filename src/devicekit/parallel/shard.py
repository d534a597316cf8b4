"""``dk.shard``: FSDP2 the way the advisor recommends it, in one call.

``shard(model)`` applies ``torch.distributed.fsdp.fully_shard`` to each repeated block of the
model (found automatically, see :mod:`devicekit.parallel.blocks`, or named with ``blocks=``),
then to the root, so each rank keeps 1/N of the parameters, gradients and optimizer state and
gathers one block at a time. It joins the process group first if nobody has (``dk.dist.init``:
nccl on GPUs, gloo on CPU ranks, a one-rank group in a plain process), moves the model to this
rank's device, and optionally takes a mixed-precision policy (``precision="auto"``: the dtype
``dk.mixed_precision`` picks for the device, gradients reduced in fp32) and CPU offload.

Works under ``devicekit run``, ``dk.launch`` and torchrun. Save and load the sharded model with
``dk.save_checkpoint(model, "ckpt/step-100")`` / ``dk.load_checkpoint("ckpt/step-100",
into=model)``: a ``torch.distributed.checkpoint`` directory, loadable by any number of ranks.

Usage::

    import devicekit as dk

    model = dk.shard(build_model())              # blocks found, sharded over every rank
    opt = torch.optim.AdamW(model.parameters())  # build the optimizer after sharding
    loss = model(batch).sum(); loss.backward(); opt.step()
    dk.shard(model, blocks="TransformerBlock", precision="auto", offload=True)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from devicekit.errors import DistributedError, InvalidValueError
from devicekit.parallel.blocks import BlockSpec, find_blocks

__all__ = ["shard", "is_sharded"]


def is_sharded(model: Any) -> bool:
    """Whether ``model`` is an FSDP2 module (``fully_shard`` applied to it)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _policy(precision: str | torch.dtype | None, device: torch.device) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision is None:
        return MixedPrecisionPolicy()
    if precision == "auto":
        from devicekit.placement.precision import mixed_precision

        dtype = mixed_precision(device).dtype
    elif precision in ("bf16", torch.bfloat16):
        dtype = torch.bfloat16
    elif precision in ("fp16", torch.float16):
        dtype = torch.float16
    else:
        raise InvalidValueError(f"precision {precision!r} is not 'auto', 'bf16', 'fp16' or None")
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _sum_then_divide(model: nn.Module) -> None:
    """Reduce gradients with SUM and divide after, on every FSDP module of ``model``.

    FSDP2 reduce-scatters fp32/bf16 gradients with ``ReduceOp.AVG``, which gloo in torch 2.7
    and 2.8 adds up without dividing (gradients ``world`` times too large, silently; 2.13
    divides). SUM and a division is the same mean on every release.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def shard(
    model: nn.Module,
    *,
    blocks: BlockSpec = None,
    precision: str | torch.dtype | None = None,
    offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2, block by block, then the root; return it.

    ``blocks``: None (the repeated blocks, found), a class, a class name, or dotted module
    names. ``precision``: None (fp32), "auto", "bf16" or "fp16". ``offload``: keep parameters,
    gradients and optimizer state in host RAM (``CPUOffloadPolicy``).
    """
    if not isinstance(model, nn.Module):
        raise InvalidValueError(f"shard() needs an nn.Module, got {type(model).__name__}")
    if is_sharded(model):
        raise InvalidValueError(f"model {type(model).__name__} is already sharded; call shard() once")
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    from devicekit.parallel import dist

    if precision not in (None, "auto", "bf16", "fp16", torch.bfloat16, torch.float16):
        raise InvalidValueError(f"precision {precision!r} is not 'auto', 'bf16', 'fp16' or None")
    device = dist.init() if not tdist.is_initialized() else dist.device()
    chosen = find_blocks(model, blocks)
    policy = _policy(precision, device)
    if any(p.device.type == "meta" for p in model.parameters()):
        raise InvalidValueError(
            "model has parameters on the meta device; build it for real (or call "
            "model.to_empty(device=...) and initialise it) before shard()"
        )
    model.to(device)
    try:
        mesh = init_device_mesh(device.type, (tdist.get_world_size(),))
        options: dict[str, Any] = {
            "mesh": mesh, "mp_policy": policy,
            "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
        }
        for _, block in chosen:
            fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
        fully_shard(model, **options)
        if "gloo" in str(tdist.get_backend()):
            _sum_then_divide(model)
    except (RuntimeError, ValueError, AssertionError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistributedError(f"cannot shard {type(model).__name__} over "
                               f"{tdist.get_world_size()} rank(s) on {device}: {first}") from exc
    return model
