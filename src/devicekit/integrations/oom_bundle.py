"""What an out-of-memory error leaves behind: one folder per rank with everything to fix it.

``oom_dir/rank<R>/`` (``rank<R>-2`` and so on for a later OOM of the same run) holds:

- ``report.txt``: the OOM explainer's diagnosis (asked vs free, biggest tensors, fixes ranked
  by memory recovered) and the step it happened at;
- ``report.json``: the same, machine-readable;
- ``timeline.json`` and ``memory.png``: memory per logged step up to the failure (the plot
  needs matplotlib; without it ``report.txt`` says so);
- ``snapshot.pickle`` (CUDA, when the allocator history was recorded): torch's memory snapshot,
  every live allocation with its stack; drag it into https://pytorch.org/memory_viz.

Usage::

    from devicekit.integrations.oom_bundle import write_oom_bundle

    try:
        trainer.fit(module)
    except torch.OutOfMemoryError as exc:
        folder = write_oom_bundle(exc, "oom", rank=0, step=120, samples=memory.samples)
        raise
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from devicekit.memory.oom import last_observed
from devicekit.memory.oom_explain import explain

__all__ = ["write_oom_bundle", "bundle_folder"]

Sample = tuple[int, "int | None", "int | None", int]


def bundle_folder(oom_dir: str | Path, rank: int) -> Path:
    """A new folder for this rank's bundle: ``rank<R>``, or ``rank<R>-<n>`` when that exists."""
    base = Path(oom_dir)
    base.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        folder = base / (f"rank{rank}" if n == 1 else f"rank{rank}-{n}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            n += 1


def _frames(exc: BaseException) -> list[types.FrameType]:
    found, tb = [], exc.__traceback__
    while tb is not None:
        found.append(tb.tb_frame)
        tb = tb.tb_next
    return found


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _plot(samples: list[Sample], path: Path, title: str) -> str | None:
    """Plot MiB per step; returns why not, when it could not."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return "memory.png not written: plotting needs matplotlib (pip install 'devicekit[plot]')"
    if not samples:
        return "memory.png not written: no step finished before the error"
    steps = [s[0] for s in samples]
    figure, axes = plt.subplots(figsize=(8, 4))
    for column, label in ((1, "allocated"), (2, "reserved"), (3, "process RSS")):
        values = [s[column] for s in samples]
        if all(v is not None for v in values):
            axes.plot(steps, [v / 2**20 for v in values], label=label, marker="." if len(steps) < 50 else None)
    axes.set_xlabel("step")
    axes.set_ylabel("MiB")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=100)
    plt.close(figure)
    return None


def write_oom_bundle(exc: BaseException, oom_dir: str | Path, *, rank: int = 0, step: int | None = None,
                     samples: Iterable[Sample] = (), snapshot: bool = False) -> Path:
    """Write the bundle for ``exc`` (an OOM) and return its folder; see the module docstring."""
    folder = bundle_folder(oom_dir, rank)
    frames = _frames(exc)
    try:
        diagnosis = explain(exc, frames=reversed(frames), observed=last_observed())
    finally:
        del frames
    notes: list[str] = []
    samples = list(samples)
    cuda = diagnosis.backend == "cuda" and torch.cuda.is_available()
    if snapshot and cuda:
        try:
            torch.cuda.memory._dump_snapshot(str(folder / "snapshot.pickle"))
        except Exception as err:  # the OOM is what the caller must see, never our own failure
            notes.append(f"snapshot.pickle not written: {type(err).__name__}: {err}")
    elif cuda:
        notes.append("snapshot.pickle not written: allocator history was off (oom_snapshot=False)")
    why_not = _plot(samples, folder / "memory.png", f"memory on rank {rank} up to the out-of-memory error")
    if why_not:
        notes.append(why_not)
    timeline = [{"step": s[0], "allocated": s[1], "reserved": s[2], "rss": s[3]} for s in samples]
    _write(folder / "timeline.json", json.dumps(timeline, indent=1))
    where = f"rank {rank}" + (f", step {step}" if step is not None else "")
    text = diagnosis.text() + f"\n  ({where}: {diagnosis.error})\n"
    text += "".join(f"  note: {n}\n" for n in notes)
    _write(folder / "report.txt", text)
    data: dict[str, Any] = {"rank": rank, "step": step, "notes": notes, "diagnosis": diagnosis.to_dict()}
    _write(folder / "report.json", json.dumps(data, indent=2, default=str))
    return folder
