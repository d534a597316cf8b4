"""Worker functions for the 2-process gloo tests (spawned; must be importable by module name).

Each rank runs two checks and writes what it found to ``<out>/rank<r>.json``:

* ``ddp_of_split``: model parallel inside data parallel, the seeds' "multiple machines, each
  with multiple GPUs" on CPU: the model is split over two CPU "devices", wrapped in DDP
  (``device_ids=None``: a multi-device module), trained on this rank's shard; the result must
  equal a single process training the unsplit model on the whole batch.
* ``pipeline_stage``: the same plan driving torch.distributed.pipelining (one stage per rank,
  ScheduleGPipe); this rank's parameters after training must equal the single-process reference.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

STEPS = 3
LR = 0.1


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)


def _reference() -> nn.Sequential:
    model = _model()
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def _max_diff(model: nn.Module, reference: nn.Module, only: set[int] | None = None) -> float:
    diffs = [
        (a.detach() - b.detach()).abs().max().item()
        for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        if only is None or id(a) in only
    ]
    return max(diffs) if diffs else float("nan")


def ddp_of_split(rank: int, world: int) -> dict:
    import devicekit as dk

    x, y = _data()
    shard = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    model = _model()
    split = dk.split(model, ["cpu", "cpu"], sample=x[shard])
    ddp = nn.parallel.DistributedDataParallel(split, device_ids=None)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[shard]), y[shard]).backward()
        opt.step()
    return {"counts": split.plan.counts, "max_diff": _max_diff(model, _reference())}


def pipeline_stage(rank: int, world: int) -> dict:
    import devicekit as dk

    x, y = _data()
    model = _model()
    stage = dk.pipeline_stage(model, "cpu", chunks=4, sample=x, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        if stage.is_first:
            stage.step(x)
        else:
            stage.step(target=y)
        opt.step()
    own = {id(p) for p in stage.parameters()}
    return {"counts": stage.plan.counts, "index": stage.index,
            "max_diff": _max_diff(model, _reference(), only=own)}


def refusal_reaches_every_rank(rank: int, world: int) -> dict:
    """Rank 0 finds the model unsplittable; every rank must raise, none may hang."""
    import devicekit as dk

    try:
        dk.pipeline_stage(nn.Sequential(nn.Linear(2, 2)), "cpu", chunks=2)
    except dk.SplitError as exc:
        return {"raised": str(exc)}
    return {"raised": None}


def _store(rank: int, world: int, out: str) -> dist.TCPStore:
    """Rank 0 binds a free port itself and publishes it (no window for another process to take it)."""
    port_file = Path(out, "port")
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        tmp.replace(port_file)
        return store
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 published no store port within 60 s")
        time.sleep(0.05)
    return dist.TCPStore("127.0.0.1", int(port_file.read_text()), world, is_master=False)


def run(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    result: dict = {}
    store = None
    try:
        store = _store(rank, world, out)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        result["ddp_of_split"] = ddp_of_split(rank, world)
        result["pipeline_stage"] = pipeline_stage(rank, world)
        result["refusal"] = refusal_reaches_every_rank(rank, world)
        dist.barrier()  # no rank tears its group down while another still talks to it
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        _close(store, rank, world)


def _close(store: dist.TCPStore | None, rank: int, world: int) -> None:
    """Rank 0 serves the store: it closes last, after every other rank said it is done, and
    before interpreter exit (a store server torn down by exit-time destructors while a
    client's connection closes aborted rank 0 with 'terminate called without an active
    exception' on a loaded machine)."""
    if store is None:
        return
    try:
        store.add("closed", 1)
        if rank == 0:
            deadline = time.monotonic() + 30
            while store.add("closed", 0) < world and time.monotonic() < deadline:
                time.sleep(0.01)
    except Exception:  # a rank that died took its part of the handshake with it
        pass  # the store itself is freed when run() returns, before interpreter exit
