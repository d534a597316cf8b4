"""Which strategy? Rank one GPU, DDP, FSDP, split/pipeline and CPU offload for a model.

``advise(model, sample)`` estimates one training step (``dk.estimate_memory``), reads the GPUs
that exist (the inventory, simulated GPUs included; or ``gpus=["80GiB", "24GiB"]``), keeps 10 %
of each GPU as headroom, and ranks the strategies the seeds' decision table names. A step sized
on the CPU (no CUDA here, e.g. with simulated GPUs) holds none of what a CUDA process holds
beyond its tensors, so each GPU row adds it instead of the headroom: the range nvidia-smi will
show (:func:`devicekit.memory.fit_check.gpu_need`: CUDA context, cuBLAS workspaces, allocator
reserve) is compared with the free memory, as ``est.fits(gpu)`` does: "fits", "may not fit"
(only the expected figure is free) or "does not fit".

* the model and batch fit on one GPU: train there, or, with several GPUs that each hold it,
  DDP over them for speed (memory per GPU: the step plus DDP's gradient buckets);
* it does not fit on one: FSDP over N (parameters, gradients and optimizer state sharded N
  ways, one block gathered at a time), a split / pipeline over N (``dk.plan_devices``),
  CPU offload (state in host RAM, only a block's working set on the GPU; slow but it fits).

The first row is what a careful engineer picks, with the line that runs it; every row says
the memory per GPU, whether it fits, and why.

Usage::

    import devicekit as dk

    advice = dk.advise(model, torch.empty(32, 3, 224, 224, device="meta"))
    print(advice)                 # the ranked table
    advice.best.name, advice.best.command
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from devicekit.errors import DeviceKitError, InvalidValueError
from devicekit.memory.estimate import BatchLimitWarning, MemoryEstimate, estimate_memory
from devicekit.memory.fit_check import GpuNeed, gpu_need
from devicekit.memory.losses import LossFn
from devicekit.memory.step import OptimizerSpec, StepFn
from devicekit.parallel.blocks import find_blocks
from devicekit.units import format_size, parse_size

__all__ = ["Advice", "Strategy", "advise", "HEADROOM"]

#: share of each GPU's total memory kept free (allocator fragmentation, CUDA context, spikes)
HEADROOM = 0.10


@dataclass(frozen=True)
class Strategy:
    """One way to run the step: memory per GPU, whether it fits, why, and how to run it."""

    name: str
    gpus: int
    memory_per_gpu: int
    fits: bool
    reason: str
    command: str
    batch_size: int | None = None      # per GPU
    global_batch: int | None = None
    applicable: bool = True            # False: the row does not apply here (e.g. DDP on one GPU)
    tight: bool = False                # fits only at the expected figure, not the high end: may not fit


@dataclass
class Advice:
    """Ranked strategies (``rows``; ``best`` first) and the estimate they rest on."""

    rows: list[Strategy]
    estimate: MemoryEstimate
    budgets: list[tuple[str, int]] = field(default_factory=list)   # label -> bytes the rows are compared with
    loads: dict[str, float] = field(default_factory=dict)      # label -> utilization %, where known
    #: a step sized off CUDA: what nvidia-smi will show for it on the roomiest GPU (else None)
    on_gpu: GpuNeed | None = None

    @property
    def best(self) -> Strategy:
        return self.rows[0]

    def to_dict(self) -> dict[str, Any]:
        on_gpu = self.on_gpu
        return {"best": self.best.name, "estimate": self.estimate.to_dict(),
                "gpus": [{"name": n, "usable": u, "utilization": self.loads.get(n)} for n, u in self.budgets],
                "usable_is": "free memory; the nvidia-smi range of each row is compared with it" if on_gpu
                else "free memory less 10 % headroom",
                "nvidia-smi": {"low": on_gpu.low, "expected": on_gpu.expected, "high": on_gpu.high}
                if on_gpu else None,
                "strategies": [vars(s) for s in self.rows]}

    def __str__(self) -> str:
        gpus = ", ".join(f"{n} {format_size(u)}{_load(self.loads.get(n))}" for n, u in self.budgets) or "none"
        est = self.estimate
        lines = [f"one step needs {format_size(est.peak)} (batch {est.batch_size}, "
                 f"{format_size(est.model_state)} of it weights + gradients + optimizer state)",
                 f"  assumed: {est.loop}; loss {est.loss}; sized by {est.method}"]
        if self.on_gpu is not None:
            lines += [f"  {self.on_gpu.sized()}",
                      f"free GPU memory (each row's nvidia-smi range, not its tensors alone, is checked against it): "
                      f"{gpus}", ""]
        else:
            lines += [f"usable GPU memory (free, less 10 % headroom): {gpus}", ""]
        width = max(len(s.name) for s in self.rows)
        for rank, s in enumerate(self.rows, 1):
            mark = ("may not fit" if s.tight else "fits") if s.fits else \
                "does not fit" if s.applicable else "not applicable"
            where = "/GPU" if s.gpus else " RAM"     # the CPU row: host memory, not a GPU's
            lines.append(f"{rank}. {s.name:<{width}}  {format_size(s.memory_per_gpu):>10}{where}  {mark}: {s.reason}")
            if s.fits:
                lines.append(f"   {'':<{width}}  run: {s.command}")
        return "\n".join(lines)


def _load(util: float | None) -> str:
    return f" ({util:.0f} % busy)" if util is not None and util >= 50 else ""


@dataclass(frozen=True)
class _Gpu:
    """One GPU as the rows see it: ``free`` bytes, ``usable`` (free less the headroom), its name."""

    label: str
    usable: int
    free: int
    name: str = ""


def _budgets(gpus: Sequence[Any] | None) -> tuple[list[_Gpu], dict[str, float]]:
    """Every GPU (free memory, and usable: free minus headroom x total), and their loads."""
    if gpus is None:
        from devicekit.hardware.inventory import gpus as inventory

        gpus = inventory()
    budgets, loads = [], {}
    for i, gpu in enumerate(gpus):
        if isinstance(gpu, (str, int)) and not isinstance(gpu, bool):
            size = parse_size(gpu, name=f"gpus[{i}]")
            budgets.append(_Gpu(f"gpu{i}", int(size * (1 - HEADROOM)), size))
        elif hasattr(gpu, "memory_free") and hasattr(gpu, "memory_total"):
            usable = max(int(gpu.memory_free - HEADROOM * gpu.memory_total), 0)
            label = f"gpu{getattr(gpu, 'index', i)}"
            budgets.append(_Gpu(label, usable, max(int(gpu.memory_free), 0), str(getattr(gpu, "name", ""))))
            util = getattr(gpu, "utilization", None)
            if isinstance(util, (int, float)) and not isinstance(util, bool):
                loads[label] = float(util)
        else:
            raise InvalidValueError(f"gpus[{i}] {gpu!r} is neither a dk.GPU nor a size such as '80GiB'")
    return budgets, loads


class _Rooms:
    """How a row's need (bytes of tensors at the peak, per GPU) is checked against a GPU.

    Traced on CUDA: the need against the usable memory (free, less the headroom). Sized off
    CUDA: the range nvidia-smi will show (CUDA context, cuBLAS workspaces, allocator reserve
    added) against the free memory, the rule of ``est.fits(gpu)``.
    """

    def __init__(self, est: MemoryEstimate) -> None:
        self.est = est
        self.cuda = est.device.type == "cuda"

    def room(self, gpu: _Gpu) -> int:
        """The bytes the GPU is ranked by and shown with."""
        return gpu.usable if self.cuda else gpu.free

    def need(self, need: int, gpu: _Gpu) -> GpuNeed | None:
        """What nvidia-smi will show for ``need`` on ``gpu`` (None when traced on CUDA)."""
        if self.cuda:
            return None
        return gpu_need(need, gpu.free, device_type=self.est.device.type,
                        convolutions=self.est.convolutions, name=gpu.name)

    def check(self, need: int, gpu: _Gpu) -> tuple[bool, bool]:
        """(fits, tight): tight is "may not fit", only the expected figure is free."""
        on_gpu = self.need(need, gpu)
        if on_gpu is None:
            return need <= gpu.usable, False
        return on_gpu.ok, on_gpu.verdict == "may not fit"

    def tensor_room(self, gpu: _Gpu) -> int:
        """The largest peak of tensors that fits ``gpu`` outright (the high end within its free memory)."""
        if self.cuda:
            return gpu.usable
        def fits(peak: int) -> bool:
            return gpu_need(peak, gpu.free, device_type=self.est.device.type, convolutions=self.est.convolutions,
                            name=gpu.name).verdict == "fits"

        if not fits(0):
            return 0
        lo, hi = 0, gpu.free + 1          # fits(lo); not fits(hi): the range only grows with the peak
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo


#: the batch search stops here; a larger answer is reported as "more than" this, never as it
BATCH_LIMIT = 1 << 20


def _largest_batch(est: MemoryEstimate, room: int) -> str:
    """The largest batch within ``room``, in words: never a silent cap, never a bare 0."""
    if est.batch_size is None:
        return "unknown (the sample has no batch dimension)"
    with warnings.catch_warnings():  # said below in words: "more than ..."
        warnings.simplefilter("ignore", BatchLimitWarning)
        n = est.max_batch_size(room, limit=BATCH_LIMIT)
    if n == 0:
        return "not even batch 1"
    if n >= BATCH_LIMIT:
        return f"more than {BATCH_LIMIT:,} (the search stops there)"
    return f"{n:,}"


def advise(
    model: nn.Module,
    sample: Any,
    *,
    gpus: Sequence[Any] | None = None,
    optimizer: OptimizerSpec = "adam",
    precision: str | torch.dtype | None = None,
    batch_size: int | None = None,
    host_memory: int | str | None = None,
    loss_fn: str | LossFn | None = None,
    step: StepFn | None = None,
) -> Advice:
    """Rank the strategies for training ``model`` on ``sample``'s batch; see the module doc.

    ``loss_fn`` / ``step``: the loss or the whole step of the user's loop, as for
    ``dk.estimate_memory`` (default: cross-entropy, output kept until the next forward returns).
    """
    est = estimate_memory(model, sample, optimizer=optimizer, precision=precision, batch_size=batch_size,
                          loss_fn=loss_fn, step=step)
    gpus_found, loads = _budgets(gpus)
    rooms = _Rooms(est)
    gpus_found.sort(key=lambda g: (-rooms.room(g), loads.get(g.label, 0.0)))   # most room first; idler on a tie
    if host_memory is None:
        import psutil

        host = int(psutil.virtual_memory().available * (1 - HEADROOM))
    else:
        host = parse_size(host_memory, name="host_memory")
    rows = _strategies(model, est, gpus_found, host, loads, rooms)
    on_gpu = rooms.need(est.peak, gpus_found[0]) if gpus_found else None
    return Advice(rows=_rank(rows), estimate=est, budgets=[(g.label, rooms.room(g)) for g in gpus_found],
                  loads=loads, on_gpu=on_gpu)


def _ddp_speed(used: list[_Gpu], loads: dict[str, float]) -> str:
    """How fast DDP over ``used`` is against one GPU: it runs at the pace of its slowest rank."""
    n = len(used)
    models = sorted({g.name for g in used if g.name})
    busy = [f"{g.label} {loads[g.label]:.0f} % busy" for g in used if loads.get(g.label, 0.0) >= 50]
    if len(models) > 1 or busy:
        why = ", ".join(([" and ".join(models) + " mixed"] if len(models) > 1 else []) + busy)
        return f"at the pace of the slowest of them ({why}), so less than {n}x the speed of one"
    return f"about {n}x the speed of one"


def _on_gpu(rooms: _Rooms, need: int, gpu: _Gpu) -> str:
    """"; sized on the CPU; on a GPU nvidia-smi will show about ..." for a step sized off CUDA, else ""."""
    on_gpu = rooms.need(need, gpu)
    return f"; {on_gpu.sized()}" if on_gpu is not None else ""


def _strategies(model: nn.Module, est: MemoryEstimate, budgets: list[_Gpu], host: int,
                loads: dict[str, float], rooms: _Rooms) -> list[Strategy]:
    peak, state, batch = est.peak, est.model_state, est.batch_size
    working = peak - state                         # activations, temporaries, inputs at the peak
    blocks = find_blocks(model)
    largest = max((sum(p.numel() * p.element_size() for p in m.parameters()) for _, m in blocks),
                  default=state // 4 if state else 0)
    rows: list[Strategy] = []
    if not budgets:
        rows.append(Strategy("cpu", 0, peak, peak <= host, f"no GPU; the step needs {format_size(peak)} "
                             f"of {format_size(host)} host RAM", "python train.py  # on the CPU",
                             batch, batch))
        return rows
    best = budgets[0]
    best_room = rooms.room(best)
    single_batch = _largest_batch(est, rooms.tensor_room(best))
    fits_one, tight_one = rooms.check(peak, best)
    there = f"{best.label}{_load(loads.get(best.label))}"
    sized = f"{_on_gpu(rooms, peak, best)};" if not rooms.cuda else ","
    rows.append(Strategy(
        "one GPU", 1, peak, fits_one,
        (f"the step needs {format_size(peak)}{sized} the roomiest GPU ({there}) has {format_size(best_room)} "
         f"free{', not the high end' if tight_one else ''}; largest batch there: "
         f"{single_batch}")
        if fits_one else
        f"the step needs {format_size(peak)}{sized if not rooms.cuda else ''} but the roomiest GPU ({there}) "
        f"has {format_size(best_room)} free (largest batch there: {single_batch})",
        "devicekit run --gpus 1 -- python train.py", batch, batch, tight=tight_one))
    # DDP's buckets hold a second copy of every gradient, whatever part of them is live at the peak
    buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    ddp_need = peak + buckets
    checks = [rooms.check(ddp_need, g) for g in budgets]
    sure = sum(1 for ok, tight in checks if ok and not tight)
    ddp_n = sure if sure >= 2 else sum(1 for ok, _ in checks if ok)
    ddp_tight = sure < 2 <= ddp_n
    n_all = len(budgets)
    speed = _ddp_speed([g for g, (ok, _) in zip(budgets, checks, strict=True) if ok][:ddp_n], loads)
    rows.append(Strategy(
        f"DDP over {max(ddp_n, 2) if n_all > 1 else 1}", max(ddp_n, 1), ddp_need, ddp_n >= 2,
        (f"{ddp_n} GPUs each hold the step plus DDP's gradient buckets"
         f"{' (tightly: they may not)' if ddp_tight else ''}; global batch "
         f"{ddp_n * (batch or 1)} ({batch} per GPU), {speed}"
         f"{_on_gpu(rooms, ddp_need, best)}")
        if ddp_n >= 2 else (f"needs {format_size(ddp_need)} per GPU (the step + gradient buckets"
                            f"{_on_gpu(rooms, ddp_need, best)}); {ddp_n} GPU(s) have that"
                            if n_all > 1 else "only one GPU"),
        f"devicekit run --gpus {max(ddp_n, 2)} -- python train.py  # model = dk.ddp(model)",
        batch, (batch or 1) * max(ddp_n, 1), applicable=n_all > 1, tight=ddp_tight))
    for n in range(2, n_all + 1) or [n_all]:
        fsdp_need = state // n + working + 2 * largest
        gpu = budgets[n - 1]
        fsdp_ok, fsdp_tight = rooms.check(fsdp_need, gpu)
        if fsdp_ok or n == n_all:
            break
    fsdp_fits = n_all >= 2 and fsdp_ok
    rows.append(Strategy(
        f"FSDP over {n}", n, fsdp_need, fsdp_fits,
        f"weights, gradients and optimizer state ({format_size(state)}) sharded {n} ways, "
        f"{len(blocks)} blocks gathered one at a time (largest {format_size(largest)}), plus "
        f"{format_size(working)} of activations and temporaries per GPU; global batch {n * (batch or 1)}"
        f"{_on_gpu(rooms, fsdp_need, gpu)}{'; it may not fit' if fsdp_fits and fsdp_tight else ''}"
        if n_all >= 2 else "needs at least 2 GPUs",
        f"devicekit run --gpus {n} -- python train.py  # model = dk.shard(model)", batch, n * (batch or 1),
        applicable=n_all >= 2, tight=fsdp_fits and fsdp_tight))
    rows.append(_split_row(model, est, budgets, rooms))
    offload_need = working + 2 * largest
    offload_ok, offload_tight = rooms.check(offload_need, best)
    offload_fits = offload_ok and state <= host
    rows.append(Strategy(
        "FSDP + CPU offload", 1, offload_need, offload_fits,
        f"weights, gradients and optimizer state ({format_size(state)}) in host RAM "
        f"({format_size(host)} usable), one block at a time on the GPU; slow (every step moves "
        f"the model over PCIe){_on_gpu(rooms, offload_need, best)}"
        f"{'; it may not fit' if offload_fits and offload_tight else ''}",
        "devicekit run --gpus 1 -- python train.py  # model = dk.shard(model, offload=True)",
        batch, batch, tight=offload_fits and offload_tight))
    return rows


def _split_row(model: nn.Module, est: MemoryEstimate, budgets: list[_Gpu], rooms: _Rooms) -> Strategy:
    from devicekit.modelparallel.plan import plan_devices

    # sized off CUDA: each GPU's room for tensors once the CUDA context and workspaces are in
    memory = {f"cuda:{i}": rooms.tensor_room(g) for i, g in enumerate(budgets)}
    try:
        # weights, gradients and optimizer state per layer; the activations are added below
        plan = plan_devices(model, memory, training=True, optimizer=est.optimizer
                            if est.optimizer != "custom" else 2.0)
    except DeviceKitError as exc:
        return Strategy("split / pipeline", len(budgets), est.peak, False,
                        str(exc).split(";")[0], "model = dk.split(model, dk.plan_devices(model))")
    per_gpu = max(p.memory for p in plan.parts) + (est.peak - est.model_state) // max(len(plan.parts), 1)
    n = len(plan.parts)
    if n < 2:
        return Strategy("split / pipeline", 1, per_gpu, False, "not needed: the layers fit on one GPU",
                        "model = dk.split(model, dk.plan_devices(model))", applicable=False)
    ok, tight, sized = True, False, ""
    if not rooms.cuda:      # the activations were added after the plan: check each part's GPU
        used = [budgets[p.device.index] for p in plan.parts
                if p.device.type == "cuda" and p.device.index is not None] or budgets[:n]
        checks = [rooms.check(per_gpu, g) for g in used]
        ok, tight = all(c[0] for c in checks), any(c[1] for c in checks)
        sized = _on_gpu(rooms, per_gpu, min(used, key=lambda g: g.free))
    return Strategy(f"split / pipeline over {n}", n, per_gpu, ok,
                    f"layers balanced over {n} GPUs by dk.plan_devices; one GPU works at a time "
                    f"(a Pipeline with chunks overlaps them){sized}{'; it may not fit' if ok and tight else ''}",
                    "model = dk.Pipeline(model, dk.plan_devices(model, spread=True), chunks=4)",
                    tight=ok and tight)


def _rank(rows: list[Strategy]) -> list[Strategy]:
    """Fitting rows first, in the order a careful engineer prefers; then the rest."""
    def preference(s: Strategy) -> tuple[int, int]:
        one_fits = any(r.name == "one GPU" and r.fits for r in rows)
        order = {"DDP": 0, "one GPU": 1, "FSDP over": 2, "split": 3, "FSDP + CPU": 4, "cpu": 5}
        key = next(v for k, v in order.items() if s.name.startswith(k))
        if not one_fits and s.name.startswith("DDP"):
            key = 9
        return (0 if s.fits and not s.tight else 1 if s.fits else 2 if s.applicable else 3, key)

    return sorted(rows, key=preference)
