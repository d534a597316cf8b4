"""What each layer of a sequential model costs: parameters, activations, time.

Sizes need no real memory: a model built on the meta device (``with torch.device("meta"):``)
is measured by running a meta copy of the sample through it, so a 1B-parameter stack is sized
on a laptop. Activations are the tensors autograd saves for backward (counted with
``torch.autograd.graph.saved_tensors_hooks``), not a guess from the output shape. Times are
forward plus backward on a real sample. Profiling leaves the model as it was: buffers (BatchNorm
running statistics), ``.grad`` and the RNG state are untouched.

Usage::

    import torch
    from torch import nn
    from devicekit.modelparallel.layer_profile import profile_layers, sequential_layers

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(16)])
    costs = profile_layers(sequential_layers(model), torch.empty(8, 8192, device="meta"))
    costs[0].param_bytes, costs[0].activation_bytes   # 268468224, 262144
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from devicekit.errors import InvalidValueError, SplitError
from devicekit.modelparallel.batchnorm import DeferredBatchNorm
from devicekit.modelparallel.state_guard import StateGuard
from devicekit.placement.walk import map_tensors

__all__ = ["LayerCost", "optimizer_factor", "profile_layers", "sequential_layers"]

# optimizer name -> copies of the parameters it keeps as state
_OPTIMIZER_STATE = {"adam": 2.0, "adamw": 2.0, "sgd-momentum": 1.0, "momentum": 1.0,
                    "rmsprop": 1.0, "adagrad": 1.0, "sgd": 0.0, "none": 0.0,
                    # the estimate's other names (devicekit.memory.step.OPTIMIZERS); adafactor's
                    # factored state is far less than a copy for matrices, a copy for vectors
                    "adafactor": 1.0, "adadelta": 2.0, "adamax": 2.0, "nadam": 2.0, "radam": 2.0,
                    "sparse-adam": 2.0}


def optimizer_factor(optimizer: str | float | None) -> float:
    """Copies of the parameters an optimizer keeps: adam 2, sgd-momentum 1, sgd/None 0, or a number."""
    if optimizer is None:
        return 0.0
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        if optimizer < 0:
            raise InvalidValueError(f"optimizer {optimizer!r} must be >= 0 copies of the parameters")
        return float(optimizer)
    if isinstance(optimizer, str) and optimizer.lower() in _OPTIMIZER_STATE:
        return _OPTIMIZER_STATE[optimizer.lower()]
    names = ", ".join(repr(k) for k in _OPTIMIZER_STATE)
    raise InvalidValueError(f"optimizer {optimizer!r} is unknown; use one of {names} or a number of copies")


@dataclass(frozen=True)
class LayerCost:
    """One layer's measured cost. Bytes are for the sample's batch size."""

    name: str
    parameters: int
    param_bytes: int
    buffer_bytes: int
    #: bytes autograd saves for backward in this layer (training)
    activation_bytes: int = 0
    #: bytes of the layer's input plus output: the peak it adds when nothing is saved (inference)
    transient_bytes: int = 0
    #: forward + backward seconds on the sample (None: not measured)
    seconds: float | None = None

    def memory(self, *, training: bool = True, optimizer: float = 2.0) -> int:
        """Bytes this layer holds on its device: weights (+ grads + optimizer state) + activations."""
        if training:
            return int(self.param_bytes * (2.0 + optimizer) + self.buffer_bytes + self.activation_bytes)
        return self.param_bytes + self.buffer_bytes


def sequential_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers of ``model`` in execution order; refuse modules whose order is not known.

    Nested plain ``nn.Sequential`` containers are flattened (their forward only chains
    children), so layers can be balanced finely. Anything else is refused with the fix. A layer
    object listed twice is returned twice (it runs twice; ``named_children`` would skip it).
    """
    if isinstance(model, nn.ModuleList):
        raise SplitError(
            "model is an nn.ModuleList, which has no forward and no order of execution; "
            "if its children run one after another, pass nn.Sequential(*model_list)"
        )
    if not isinstance(model, nn.Sequential) or type(model).forward is not nn.Sequential.forward:
        kind = type(model).__name__
        raise SplitError(
            f"model {kind} is not a plain nn.Sequential: its forward may branch or skip, so the "
            "order of its children is not the order they run; wrap the parts that run one after "
            "another in nn.Sequential(...) and split that"
        )
    layers: list[tuple[str, nn.Module]] = []

    def walk(seq: nn.Sequential, prefix: str) -> None:
        for name, child in seq._modules.items():  # every entry, repeats included
            if child is None:
                continue
            full = f"{prefix}{name}"
            if type(child) is nn.Sequential and len(child) > 0:
                walk(child, f"{full}.")
            else:
                layers.append((full, child))

    walk(model, "")
    if not layers:
        raise SplitError("model nn.Sequential() has no layers; there is nothing to split")
    return layers


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)



def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


def _layer_device(layer: nn.Module) -> torch.device | None:
    for tensor in layer.parameters():
        return tensor.device
    for tensor in layer.buffers():
        return tensor.device
    return None


def _prepare_input(x: Any, device: torch.device | None) -> Any:
    def fix(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if device is not None and t.device != device:
            t = torch.empty_like(t, device=device) if device.type == "meta" else t.to(device)
        if t.is_floating_point() or t.is_complex():
            # a non-leaf copy: a layer working in place (ReLU(inplace=True)) may write its input
            t = t.requires_grad_(True).clone()
        return t

    return map_tensors(x, fix)


def _saved_bytes(layer: nn.Module, x: Any) -> tuple[Any, int]:
    """Run ``layer(x)`` with grad and count the bytes autograd saves (parameters excluded)."""
    params = {id(p) for p in layer.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        base = t._base if t._base is not None else t
        if id(t) in params or id(base) in params or id(base) in seen:
            return t
        seen.add(id(base))
        total += base.numel() * base.element_size()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    return out, total


def _time_layer(layer: nn.Module, x: Any, repeat: int) -> tuple[Any, float]:
    best = float("inf")
    out: Any = None
    for _ in range(repeat + 1):  # the first run warms up
        start = time.perf_counter()
        with torch.enable_grad():
            out = layer(x)
            outs = [t for t in _tensors(out) if t.requires_grad]
            inputs = [t for t in _tensors(x) if t.requires_grad] + [
                p for p in layer.parameters() if p.requires_grad
            ]
            if outs and inputs:
                torch.autograd.grad(outs, inputs, [torch.ones_like(t) for t in outs], allow_unused=True)
        for t in _tensors(out):
            if t.device.type == "cuda":
                torch.cuda.synchronize(t.device)
        best = min(best, time.perf_counter() - start)
    return out, best


def profile_layers(
    layers: list[tuple[str, nn.Module]],
    sample: Any = None,
    *,
    measure_time: bool = False,
    repeat: int = 3,
    training: bool = True,
) -> list[LayerCost]:
    """Measure each layer: parameters always; activations with a sample; time if asked.

    Layers run in training mode (``training=True``, what a split model trains in; as
    torchgpipe profiles) and get their own modes back afterwards. A parameter or buffer used by
    several layers (a repeated layer, tied weights) is counted once, at its first use.
    """
    on_meta = any(_layer_device(layer) == torch.device("meta") for _, layer in layers)
    if measure_time and (sample is None or on_meta):
        raise SplitError(
            "balance='time' needs real parameters and a real sample to time; pass sample=... "
            "or use balance='size' (works on the meta device)"
        )
    modes = {id(m): (m, m.training) for _, layer in layers for m in layer.modules()}
    counted: set[int] = set()
    x = sample
    try:
        with StateGuard([layer for _, layer in layers]):  # buffers, RNG: as they were
            for _, layer in layers:
                layer.train(training)
            costs = _profile(layers, x, counted, on_meta, measure_time, repeat)
    finally:
        for module, mode in modes.values():
            module.training = mode
            if isinstance(module, DeferredBatchNorm):
                module.discard()  # what profiling tracked is no mini-batch of the user's
    return costs


def _profile(layers: list[tuple[str, nn.Module]], x: Any, counted: set[int], on_meta: bool,
             measure_time: bool, repeat: int) -> list[LayerCost]:
    costs: list[LayerCost] = []
    for name, layer in layers:
        params = [p for p in layer.parameters() if id(p) not in counted]
        buffers = [b for b in layer.buffers() if id(b) not in counted]
        counted.update(id(t) for t in (*params, *buffers))
        cost = dict(
            name=name,
            parameters=sum(p.numel() for p in params),
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            buffer_bytes=sum(b.numel() * b.element_size() for b in buffers),
        )
        if x is not None:
            device = _layer_device(layer)
            sample_on_meta = any(t.device.type == "meta" for t in _tensors(x))
            if device is None:
                device = torch.device("meta") if on_meta or sample_on_meta else None
            elif sample_on_meta and device.type != "meta":
                layer = copy.deepcopy(layer).to("meta")  # a shape-only sample: size a meta copy
                device = torch.device("meta")
            x = _prepare_input(x, device)
            try:
                out, saved = _saved_bytes(layer, x)
                seconds = None
                if measure_time:
                    out, seconds = _time_layer(layer, x, repeat)
            except Exception as exc:
                raise SplitError(
                    f"layer {name!r} ({type(layer).__name__}) failed on the sample: "
                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}; "
                    "check the sample's shape and dtype"
                ) from exc
            cost.update(activation_bytes=saved, transient_bytes=_nbytes(x) + _nbytes(out),
                        seconds=seconds)
            x = map_tensors(out, lambda t: t.detach())
        costs.append(LayerCost(**cost))  # type: ignore[arg-type]
    return costs
