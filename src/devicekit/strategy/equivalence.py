"""Check that a parallel training set-up computes the same gradients as one process.

One training step of the parallel set-up (DDP over ``world_size`` gloo CPU ranks, each on its
own shard of the batch; :class:`devicekit.BalancedDataParallel`; or your own callable) runs
from the same initial weights as a single-process step on the full batch, and every
parameter's gradient is compared. When they differ, the report says why when it can tell:
sum vs mean reduction (gradients off by a factor ``world_size``), every rank training on the
same shard, BatchNorm statistics, dropout, or a constant scale.

Usage::

    import devicekit as dk

    def build() -> torch.nn.Module:          # module level: it is sent to the ranks
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    batch = (torch.randn(16, 8), torch.randn(16, 1))
    report = dk.check_equivalence(build, batch, torch.nn.MSELoss(), world_size=2)
    print(report)            # one line per parameter: max abs / rel difference, ok or FAIL

    dk.check_equivalence(build, batch, torch.nn.MSELoss(reduction="sum"))
    # GradientMismatchError: ... sum vs mean reduction: the loss uses reduction='sum' ...

A callable ``parallel(model, batch, loss_fn)`` runs one step its own way starting from
``model`` (already holding the reference's initial weights) and returns ``{name: grad}`` or
``None`` to mean "read ``model``'s ``.grad``".
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from devicekit.errors import GradientMismatchError, InvalidValueError
from devicekit.parallel.rank import is_distributed, rank_device

__all__ = ["check_equivalence", "EquivalenceReport", "ParameterDiff"]

Grads = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ParameterDiff:
    """How one parameter's parallel gradient differs from the reference.

    ``max_rel_diff`` is ``max_abs_diff`` divided by the largest reference gradient entry of the
    parameter (so near-zero entries do not blow it up).
    """

    name: str
    shape: tuple[int, ...]
    max_abs_diff: float
    max_rel_diff: float
    passed: bool


@dataclass
class EquivalenceReport:
    """Result of :func:`check_equivalence`; ``str(report)`` is a readable table."""

    passed: bool
    parallel: str
    world_size: int
    rtol: float
    atol: float
    parameters: list[ParameterDiff] = field(default_factory=list)
    #: best-fit scalar ``parallel ≈ ratio * reference`` over all gradients (1.0 when equal)
    ratio: float | None = None
    #: one line explaining a mismatch ("" when passed)
    diagnosis: str = ""

    @property
    def failed(self) -> list[ParameterDiff]:
        return [p for p in self.parameters if not p.passed]

    def __str__(self) -> str:
        verdict = "gradients match" if self.passed else "gradients DIFFER"
        lines = [f"{verdict}: {self.parallel} (world size {self.world_size}) vs one process, "
                 f"rtol={self.rtol:g} atol={self.atol:g}"]
        width = max([len(p.name) for p in self.parameters] + [9])
        lines.append(f"  {'parameter':<{width}}  {'max abs diff':>12}  {'max rel diff':>12}  result")
        for p in self.parameters:
            lines.append(f"  {p.name:<{width}}  {p.max_abs_diff:>12.3g}  {p.max_rel_diff:>12.3g}  "
                         f"{'ok' if p.passed else 'FAIL'}")
        if self.diagnosis:
            lines.append(f"diagnosis: {self.diagnosis}")
        return "\n".join(lines)


def _grads(model: nn.Module) -> Grads:
    return {name: p.grad.detach().to("cpu", copy=True)
            for name, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _split_batch(batch: Any) -> tuple[Any, Any]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise InvalidValueError(
            f"batch must be a pair (inputs, targets), got {type(batch).__name__}"
            f"{' of length ' + str(len(batch)) if isinstance(batch, (tuple, list)) else ''}")
    return batch[0], batch[1]


def _shard(obj: Any, parts: int, index: int) -> Any:
    """Contiguous shard ``index`` of ``parts`` along dim 0 of every tensor in ``obj``."""
    if isinstance(obj, torch.Tensor):
        return obj.tensor_split(parts, dim=0)[index]
    if isinstance(obj, (list, tuple)):
        return type(obj)(_shard(item, parts, index) for item in obj)
    if isinstance(obj, dict):
        return {key: _shard(value, parts, index) for key, value in obj.items()}
    return obj


def _moved(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor (in lists, tuples, dicts) on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_moved(item, device) for item in obj)
    if isinstance(obj, dict):
        return {key: _moved(value, device) for key, value in obj.items()}
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return [t for item in items for t in _tensors(item)]


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _fresh_model(model_fn: Callable[[], nn.Module], state: Mapping[str, torch.Tensor]) -> nn.Module:
    model = model_fn()
    if not isinstance(model, nn.Module):
        raise InvalidValueError(f"model_fn must return an nn.Module, got {type(model).__name__}")
    model.load_state_dict(state)
    return model


def _step(model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable[..., torch.Tensor]) -> None:
    model.zero_grad(set_to_none=True)
    loss_fn(model(inputs), targets).backward()


def _ddp_rank_step(model_fn: Callable[[], nn.Module], state: Mapping[str, torch.Tensor],
                   batch: tuple[Any, Any], loss_fn: Callable[..., torch.Tensor], seed: int) -> Grads:
    """One rank's DDP step on its contiguous shard (inside a gloo rank or the user's job)."""
    from devicekit.parallel.ddp import ddp, unwrap_model

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = ddp(_fresh_model(model_fn, state))
    device = next(unwrap_model(model).parameters()).device
    inputs, targets = (_moved(_shard(part, world, rank), device) for part in batch)
    _step(model, inputs, targets, loss_fn)
    return _grads(unwrap_model(model))


def _run_parallel(parallel: str | Callable[..., Any], model_fn: Callable[[], nn.Module],
                  state: Mapping[str, torch.Tensor], batch: tuple[Any, Any],
                  loss_fn: Callable[..., torch.Tensor], world_size: int, seed: int,
                  timeout: float) -> tuple[Grads, int, str]:
    """The parallel gradients, the number of shards they were computed from, and a label."""
    if parallel == "ddp" and is_distributed():
        # called inside a running job (devicekit run, torchrun, dk.launch): use its ranks
        grads = _ddp_rank_step(model_fn, state, batch, loss_fn, seed)
        return grads, dist.get_world_size(), "DDP"
    if parallel == "ddp":
        from devicekit.jobs.launch import launch

        cpu = torch.device("cpu")
        cpu_state = {k: v.detach().cpu() for k, v in state.items()}
        cpu_batch = tuple(_moved(part, cpu) for part in batch)  # the ranks are CPU gloo processes
        # devices="cpu": gloo CPU ranks even on a GPU machine, and no GPU leased for a check
        per_rank = launch(_ddp_rank_step, model_fn, cpu_state, cpu_batch, loss_fn, seed,
                          nprocs=world_size, devices="cpu", timeout=timeout)
        for rank, grads in enumerate(per_rank[1:], start=1):
            for name, grad in grads.items():
                if not torch.equal(grad, per_rank[0][name]):
                    raise GradientMismatchError(
                        f"DDP ranks 0 and {rank} hold different gradients for {name!r}: the "
                        f"all-reduce did not run; make sure every rank calls backward",
                        report=None)
        return per_rank[0], world_size, "DDP"
    torch.manual_seed(seed)
    model = _fresh_model(model_fn, state)
    if parallel == "balanced":
        from devicekit.parallel.balanced_dp import BalancedDataParallel

        wrapped = BalancedDataParallel(model, loss_fn)
        wrapped.zero_grad(set_to_none=True)
        wrapped(*batch).backward()
        return _grads(model), max(1, len(wrapped.device_ids)), "BalancedDataParallel"
    if callable(parallel):
        returned = parallel(model, batch, loss_fn)
        if returned is None:
            return _grads(model), world_size, getattr(parallel, "__name__", "callable")
        if not isinstance(returned, Mapping):
            raise InvalidValueError(
                f"parallel callable returned {type(returned).__name__}; return {{name: grad}} "
                f"or None")
        grads = {name: g.detach().to("cpu") for name, g in returned.items() if g is not None}
        return grads, world_size, getattr(parallel, "__name__", "callable")
    raise InvalidValueError(
        f"parallel={parallel!r} is not one of 'ddp', 'balanced' or a callable")


def _flat(grads: Grads, names: list[str]) -> torch.Tensor:
    return torch.cat([grads[n].reshape(-1).double() for n in names]) if names else torch.zeros(0)


def _diagnose(par: Grads, ref: Grads, shards: list[Grads], world: int, model: nn.Module,
              loss_fn: Any, rtol: float, atol: float) -> tuple[str, float | None]:
    missing = [n for n in ref if n not in par]
    if missing:
        return (f"parameter {missing[0]!r} got no gradient in the parallel run (of {len(missing)} "
                f"missing); it is unused there or not synchronised", None)
    names = list(ref)
    p_vec, r_vec = _flat(par, names), _flat(ref, names)
    denom = float(r_vec.dot(r_vec))
    ratio = float(p_vec.dot(r_vec)) / denom if denom > 0 else None

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.allclose(a, b, rtol=max(rtol, 1e-4), atol=max(atol, 1e-7))

    reduction = getattr(loss_fn, "reduction", None)
    if world > 1 and close(p_vec, r_vec / world):
        said = ("your loss uses reduction='sum'" if reduction == "sum"
                else "the loss sums over the batch instead of averaging")
        return (f"sum vs mean reduction: the parallel gradients are the reference divided by "
                f"world_size={world}; {said}, so each rank's gradient sums only its shard and "
                f"DDP averages over ranks; use reduction='mean', or multiply the loss by "
                f"world_size", ratio)
    if world > 1 and close(p_vec, r_vec * world):
        return (f"sum vs mean reduction: the parallel gradients are world_size={world} times the "
                f"reference; gradients are summed over ranks (all_reduce SUM) where they should "
                f"be averaged, or the parallel loss sums while the reference averages; divide "
                f"by world_size or use reduction='mean' on both", ratio)
    for index, shard in enumerate(shards):
        if close(p_vec, _flat(shard, names)):
            return (f"duplicated shards: the parallel gradients equal those of shard {index} "
                    f"alone, so every rank trained on the same samples; give each rank its own "
                    f"part of the data (dk.distributed_sampler / DistributedSampler)", ratio)
    if ratio is not None and ratio > 0 and close(p_vec, r_vec * ratio):
        return (f"the parallel gradients are the reference scaled by {ratio:.4g}: the loss is "
                f"scaled differently (loss scaling, gradient accumulation, a divisor); make "
                f"both runs scale it the same way", ratio)
    kinds = {type(m).__name__ for m in model.modules()}
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)
           for m in model.modules()):
        return ("the model has BatchNorm: each rank normalises with its own shard's statistics; "
                "use nn.SyncBatchNorm.convert_sync_batchnorm(model) or check in eval mode", ratio)
    if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules()) and model.training:
        return ("the model has Dropout, whose masks differ between processes; check with "
                "model_fn returning the model in eval() mode", ratio)
    worst = max(names, key=lambda n: float((par[n] - ref[n]).abs().max()) if ref[n].numel() else 0.0)
    return (f"gradients differ beyond a scale factor (worst: {worst!r}; layers: "
            f"{', '.join(sorted(kinds)[:6])}); check that every rank starts from the same "
            f"weights, sees its own shard, and runs the same forward", ratio)


@contextlib.contextmanager
def _progress(what: str, enabled: bool) -> Iterator[None]:
    """One stderr line when the (seconds-long: processes start, torch imports) run begins and
    one when it ends, so a long check does not look hung."""
    if not enabled:
        yield
        return
    start = time.monotonic()
    print(f"check_equivalence: running the {what}...", file=sys.stderr, flush=True)
    yield
    print(f"check_equivalence: parallel step done in {time.monotonic() - start:.1f} s",
          file=sys.stderr, flush=True)


def check_equivalence(model_fn: Callable[[], nn.Module], batch: tuple[Any, Any],
                      loss_fn: Callable[..., torch.Tensor], *,
                      parallel: str | Callable[..., Any] = "ddp", world_size: int | None = None,
                      rtol: float = 1e-4, atol: float = 1e-6, raise_on_mismatch: bool = True,
                      timeout: float = 60.0, seed: int = 0) -> EquivalenceReport:
    """Run one step of ``parallel`` and one single-process step; compare every gradient.

    ``model_fn()`` builds the model (on the CPU for ``"ddp"``, whose ranks are gloo CPU
    processes); the reference's initial weights are copied into every other copy, so
    ``model_fn`` need not be seeded. ``batch`` is ``(inputs, targets)``; with ``"ddp"`` its size
    must divide by ``world_size`` (default 2) and rank ``r`` gets the ``r``-th contiguous shard. For
    ``"ddp"``, ``model_fn`` and ``loss_fn`` must be picklable (module-level functions,
    ``nn.Module`` losses). The ranks are started by :func:`devicekit.launch` (``devices="cpu"``:
    CUDA hidden, nothing leased); ``timeout`` bounds their step once they are up.

    Called inside a running distributed job (``devicekit run``, torchrun, ``dk.launch``: a
    process group with several ranks), ``"ddp"`` uses that job's ranks and devices instead of
    starting processes: call it on every rank; rank 0's weights and batch are broadcast, and
    ``world_size`` must be None or the job's size.

    Returns an :class:`EquivalenceReport`. On a mismatch raises
    :class:`devicekit.GradientMismatchError` (carrying ``.report``) unless
    ``raise_on_mismatch=False``.
    """
    in_job = parallel == "ddp" and is_distributed()
    if in_job:
        if world_size is not None and world_size != dist.get_world_size():
            raise InvalidValueError(
                f"world_size={world_size} but this job has {dist.get_world_size()} ranks; leave "
                f"world_size=None inside a distributed job")
        world_size = dist.get_world_size()
    elif world_size is None:
        world_size = 2
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidValueError(f"world_size={world_size!r} must be a positive integer")
    inputs, targets = _split_batch(batch)
    first = _first_tensor(inputs)
    if first is None or first.dim() == 0:
        raise InvalidValueError("batch inputs hold no batched tensor; pass (inputs, targets) tensors")
    size = int(first.shape[0])
    if parallel == "ddp" and size % world_size:
        raise InvalidValueError(
            f"batch size {size} does not divide by world_size={world_size}; DDP averages equal "
            f"shards, so use a batch size that is a multiple of {world_size}")

    torch.manual_seed(seed)
    reference = model_fn()
    if not isinstance(reference, nn.Module):
        raise InvalidValueError(f"model_fn must return an nn.Module, got {type(reference).__name__}")
    if in_job:  # every rank computes the reference too, on its own device, from rank 0's data
        device = rank_device()
        reference.to(device)
        inputs, targets = _moved(inputs, device), _moved(targets, device)
        with torch.no_grad():
            for tensor in [*reference.state_dict().values(), *_tensors((inputs, targets))]:
                dist.broadcast(tensor, src=0)
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}

    name = parallel if isinstance(parallel, str) else getattr(parallel, "__name__", "parallel")
    loud = not in_job or dist.get_rank() == 0
    with _progress(f"{name} step on {world_size} rank(s), then one process", loud):
        parallel_grads, shard_count, label = _run_parallel(
            parallel, model_fn, state, (inputs, targets), loss_fn, world_size, seed, timeout)

    torch.manual_seed(seed)
    _step(reference, inputs, targets, loss_fn)
    ref_grads = _grads(reference)

    diffs: list[ParameterDiff] = []
    for name, ref in ref_grads.items():
        got = parallel_grads.get(name)
        if got is None or got.shape != ref.shape:
            diffs.append(ParameterDiff(name, tuple(ref.shape), float("inf"), float("inf"), False))
            continue
        got = got.to(ref.dtype)
        abs_diff = float((got - ref).abs().max()) if ref.numel() else 0.0
        scale = float(ref.abs().max()) if ref.numel() else 0.0
        rel_diff = abs_diff / scale if scale > 0 else (0.0 if abs_diff == 0 else float("inf"))
        ok = torch.allclose(got, ref, rtol=rtol, atol=atol)
        diffs.append(ParameterDiff(name, tuple(ref.shape), abs_diff, rel_diff, ok))
    extra = sorted(set(parallel_grads) - set(ref_grads))
    passed = all(d.passed for d in diffs) and not extra
    report = EquivalenceReport(passed=passed, parallel=label, world_size=shard_count, rtol=rtol,
                               atol=atol, parameters=diffs, ratio=1.0 if passed else None)
    if passed:
        return report
    if extra:
        report.diagnosis = (f"the parallel run has gradients for {extra[0]!r} that the reference "
                            f"lacks; it trains parameters the single-process model does not use")
    else:
        valid = {n: g.to(ref_grads[n].dtype) for n, g in parallel_grads.items()
                 if n in ref_grads and g.shape == ref_grads[n].shape}
        shards = []
        where = next((t.device for t in reference.parameters()), torch.device("cpu"))
        for index in range(shard_count if shard_count > 1 else 0):
            shard_model = _fresh_model(model_fn, state).to(where)  # beside the reference
            torch.manual_seed(seed)
            _step(shard_model, _shard(inputs, shard_count, index), _shard(targets, shard_count, index),
                  loss_fn)
            shards.append(_grads(shard_model))
        report.diagnosis, report.ratio = _diagnose(valid, ref_grads, shards, shard_count,
                                                   reference, loss_fn, rtol, atol)
    if raise_on_mismatch:
        worst = max(report.failed, key=lambda d: d.max_abs_diff, default=None)
        where = (f" (worst {worst.name!r}: max abs diff {worst.max_abs_diff:.3g})"
                 if worst is not None else "")
        raise GradientMismatchError(
            f"{label} gradients differ from one process in {len(report.failed)} of "
            f"{len(diffs)} parameter(s){where}: {report.diagnosis}", report)
    return report
