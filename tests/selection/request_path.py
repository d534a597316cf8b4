"""Follow one request through the code: which files it enters, and how often it comes back.

A *room* is a source file of devicekit outside the ground floor (``units``, ``errors``,
``moved``, ``teardown`` are used everywhere, like the standard library). The request *enters* a
room when a function of that room is called from another room (the nearest devicekit frame
below it on the stack); returning to the caller is not an entry, nor is a module's own import,
nor reading a value's property or dunder method (``gpu.label``, ``allocation.on_gpu``: a look at
data, not a visit).
A *return* is an entry into a room the request had already entered: the back-and-forth that
makes code hard to follow (selection calling the queue, the queue calling back into selection).

Usage (prints the path of ``devicekit run --gpus 1 --dry-run`` on two simulated GPUs)::

    python -m tests.selection.request_path
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import devicekit

SRC = Path(devicekit.__file__).resolve().parent
GROUND = {"units.py", "errors.py", "moved.py", "teardown.py"}


def _room(filename: str) -> str | None:
    path = Path(filename)
    try:
        rel = path.resolve().relative_to(SRC)
    except (ValueError, OSError):
        return None
    if len(rel.parts) == 1 and rel.name in GROUND:
        return None
    return str(rel)


@dataclass
class Path_:
    """The rooms a request entered, in order."""

    entries: list[str] = field(default_factory=list)

    @property
    def rooms(self) -> collections.Counter[str]:
        return collections.Counter(self.entries)

    @property
    def returns(self) -> int:
        return len(self.entries) - len(self.rooms)

    def summary(self) -> str:
        lines = [f"{len(self.entries)} entries into {len(self.rooms)} rooms, {self.returns} returns"]
        lines += [f"  {n} x {room}" for room, n in self.rooms.most_common()]
        lines.append("path: " + " > ".join(self.entries))
        return "\n".join(lines)


def _property_code() -> set[Any]:
    """The code of every property getter of devicekit's classes loaded now."""
    import functools

    out = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("devicekit") or module is None:
            continue
        for cls in list(vars(module).values()):
            if not isinstance(cls, type) or cls.__module__ != name:
                continue
            for attr in vars(cls).values():
                fget = attr.fget if isinstance(attr, property) else (
                    attr.func if isinstance(attr, functools.cached_property) else None)
                if fget is not None and hasattr(fget, "__code__"):
                    out.add(fget.__code__)
    return out


@contextlib.contextmanager
def follow() -> Iterator[Path_]:
    """Record every room entered while the block runs (this thread only)."""
    found = Path_()
    rooms: dict[str, str | None] = {}
    looks = _property_code()

    def room_of(code: Any) -> str | None:
        name = code.co_filename
        if name not in rooms:
            rooms[name] = _room(name)
        return rooms[name]

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event != "call" or code.co_name == "<module>" or code in looks or (
                code.co_name.startswith("__") and code.co_name.endswith("__")):
            return
        room = room_of(frame.f_code)
        if room is None:
            return
        caller = frame.f_back
        while caller is not None and room_of(caller.f_code) is None:
            caller = caller.f_back
        if caller is None or room_of(caller.f_code) != room:
            found.entries.append(room)

    sys.setprofile(profile)
    try:
        yield found
    finally:
        sys.setprofile(None)


def run_request(argv: list[str], gpus: list[dict[str, Any]]) -> tuple[Path_, int]:
    """``devicekit ARGV`` on simulated ``gpus`` in a private lease directory: its path and exit code."""
    from devicekit.cli.main import main

    with tempfile.TemporaryDirectory() as tmp:
        sim = Path(tmp) / "gpus.json"
        sim.write_text(json.dumps({"gpus": gpus}))
        leases = Path(tmp) / "leases"
        leases.mkdir()
        saved = {k: os.environ.get(k) for k in ("DEVICEKIT_SIMULATE", "DEVICEKIT_LEASE_DIR",
                                                "CUDA_VISIBLE_DEVICES")}
        os.environ.update(DEVICEKIT_SIMULATE=str(sim), DEVICEKIT_LEASE_DIR=str(leases))
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        code = 0
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                with contextlib.suppress(SystemExit):
                    main(argv)  # imports settle first: the path shows the request, not loading
                with follow() as found:
                    try:
                        main(argv)
                    except SystemExit as exc:
                        code = exc.code if isinstance(exc.code, int) else 1
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return found, code


RUN_ONE_GPU = ["run", "--gpus", "1", "--dry-run", "--", "python", "train.py"]
TWO_GPUS = [{"name": "NVIDIA H100 80GB HBM3", "memory_total": "80GiB", "memory_used": "1GiB",
             "utilization": 3},
            {"name": "NVIDIA H100 80GB HBM3", "memory_total": "80GiB", "memory_used": "0GiB",
             "utilization": 0}]

if __name__ == "__main__":
    path, rc = run_request(RUN_ONE_GPU, TWO_GPUS)
    print(path.summary())
    print("exit", rc)
