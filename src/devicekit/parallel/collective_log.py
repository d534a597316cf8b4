"""What a rank records of its collectives, so a supervisor can say who hangs where.

Switched on by ``dk.dist.init()`` when the launcher (``devicekit run``, ``dk.launch``) sets
``DEVICEKIT_HANG_DIR``: every ``torch.distributed`` collective called from Python is recorded
(op, process group, per-group sequence number, shapes, dtypes, the caller's file:line) in a
small in-memory ring; torch's own per-group sequence number (which DDP's bucket all-reduces
advance too) is the progress signal. A daemon thread writes ``rank<R>.progress`` when that
changes and, when the supervisor writes a new request id into ``request``, dumps this rank's
record (``rank<R>.json``) and every thread's Python stack (``rank<R>.stack``) there. Nothing is
read from the directory except the request id (a short integer, bounded read).

Usage (what ``dk.dist.init`` does; users do not call it)::

    from devicekit.parallel import collective_log

    collective_log.start_from_environment(rank=0)   # no-op unless DEVICEKIT_HANG_DIR is set
"""

from __future__ import annotations

import atexit
import collections
import faulthandler
import functools
import json
import mmap
import os
import sys
import threading
import time
from typing import Any

from devicekit.code_origin import library_of

__all__ = ["HANG_DIR_ENV", "FLIGHT_RECORDER_ENV", "REQUEST_FILE", "start_from_environment", "start",
           "records", "dump", "flight_recorder_for", "group_timeout"]

#: the directory, set by the launcher, where ranks write progress and dumps
HANG_DIR_ENV = "DEVICEKIT_HANG_DIR"
#: set by the launcher: torch Flight Recorder entries to keep on NCCL groups
FLIGHT_RECORDER_ENV = "DEVICEKIT_FLIGHT_RECORDER"
#: the file the supervisor writes a request id into
REQUEST_FILE = "request"
#: entries kept per rank
KEEP = 64
#: how often the rank's thread looks at its progress and at the request file
POLL_SECONDS = 0.5

#: collectives recorded: name -> (index of the tensor argument or None, async keyword)
_OPS = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
)


#: bytes of rank<R>.last: one entry, padded, so each rewrite covers the previous one
LAST_BYTES = 512


class _State:
    def __init__(self, directory: str, rank: int, timeout: float | None) -> None:
        self.directory = directory
        self.rank = rank
        self.timeout = timeout
        self.entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEEP)
        self.seq: dict[str, int] = {}
        self.lock = threading.Lock()
        #: rank<R>.last: the collective this rank entered last, rewritten in place on every
        #: call, so that it survives the rank (a post-mortem for ranks that died in it). A shared
        #: memory map of the file: a write is a copy into the page cache, no system call and no
        #: file-time update (a pwrite per call cost 2-3 % of a small DDP step on ext4)
        fd = os.open(os.path.join(directory, f"rank{rank}.last"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, LAST_BYTES)
            self.last = mmap.mmap(fd, LAST_BYTES)
        finally:
            os.close(fd)


_state: _State | None = None
_exited: list[bool] = []


def start_from_environment(rank: int, timeout: float | None = None) -> bool:
    """Start recording if the launcher asked for it (``DEVICEKIT_HANG_DIR``); True if on.
    ``timeout``: the process group's collective timeout in seconds (the supervisor reports a
    hang before it fires)."""
    directory = os.environ.get(HANG_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return False
    start(directory, rank, timeout)
    return True


def flight_recorder_for(backend: object) -> bool:
    """Before ``init_process_group``: switch torch's Flight Recorder on where the launcher asked
    (``DEVICEKIT_FLIGHT_RECORDER``), the group uses NCCL and the user set no buffer size of their
    own; True if switched on. Not on gloo: there it adds only DDP's bucket all-reduces to
    devicekit's own record, at a cost that measured 0.90x-1.30x a step (docs/benchmarks.md)."""
    entries = os.environ.get(FLIGHT_RECORDER_ENV, "")
    if not entries.isdigit() or {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} & set(os.environ):
        return False
    if backend is None:  # torch's default: NCCL for CUDA tensors where CUDA is usable
        import torch

        nccl = torch.cuda.is_available()
    else:
        nccl = "nccl" in str(backend).lower()
    if nccl:
        os.environ["TORCH_FR_BUFFER_SIZE"] = entries
    return nccl


def group_timeout(timeout: Any, backend: object = None) -> float | None:
    """Seconds of a process group's collective timeout: ``timeout`` (a timedelta or seconds)
    where given, else torch's default for ``backend``."""
    if timeout is not None:
        return float(timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout)
    from torch.distributed import distributed_c10d as c10d

    try:
        return float(c10d._get_default_timeout(c10d.Backend(str(backend or "gloo"))).total_seconds())
    except Exception:  # noqa: BLE001 - an older torch, or a backend name it does not know
        return float(c10d.default_pg_timeout.total_seconds())


def start(directory: str, rank: int, timeout: float | None = None) -> None:
    """Wrap torch.distributed's collectives and start the thread that answers the supervisor."""
    global _state
    if _state is not None:
        return
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d as c10d

    _state = _State(directory, rank, timeout)
    for name in _OPS:
        original = getattr(c10d, name, None)
        if original is None or getattr(original, "_devicekit_recorded", False):
            continue
        wrapped = _recording(name, original)
        setattr(c10d, name, wrapped)
        if getattr(tdist, name, None) is original:
            setattr(tdist, name, wrapped)
    _write(os.path.join(directory, f"rank{rank}.pid"), f"{os.getpid()}\n")
    atexit.register(_exiting, _state)
    threading.Thread(target=_answer, args=(_state,), name="devicekit-hang-probe",
                     daemon=True).start()


def records() -> list[dict[str, Any]]:
    """This rank's recorded collectives, oldest first (empty when recording is off)."""
    if _state is None:
        return []
    with _state.lock:
        return [dict(entry) for entry in _state.entries]


def _recording(name: str, original: Any) -> Any:
    done = "issued" if name in ("isend", "irecv") else "completed"

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        state = _state
        if state is None:
            return original(*args, **kwargs)
        entry = _entry(state, name, args, kwargs)
        result = original(*args, **kwargs)
        entry["state"] = "issued" if kwargs.get("async_op") else done
        return result

    wrapper._devicekit_recorded = True  # type: ignore[attr-defined]
    return wrapper


#: JSON text of each call site seen, so a call costs no JSON encoding of its file name
_quoted: dict[tuple[str, int], str] = {}
_dtype_names: dict[Any, str] = {}


def _entry(state: _State, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Record the collective being entered, in memory and in ``rank<R>.last`` (its memory map)."""
    group = kwargs.get("group")
    key = "default" if group is None else f"group{id(group):x}"
    shapes: list[list[int]] = []
    dtypes: list[str] = []
    for value in (*args[:2], kwargs.get("tensor"), kwargs.get("input_tensor")):
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            dtype = getattr(tensor, "dtype", None)
            if dtype is not None and hasattr(tensor, "shape") and len(shapes) < 4:
                shapes.append(list(tensor.shape))
                label = _dtype_names.get(dtype)
                if label is None:
                    label = _dtype_names[dtype] = str(dtype).replace("torch.", "")
                dtypes.append(label)
    filename, line = _caller()
    where = _quoted.get((filename, line))
    if where is None:
        where = _quoted[(filename, line)] = json.dumps(f"{filename}:{line}")
    with state.lock:
        seq = state.seq.get(key, 0) + 1
        state.seq[key] = seq
        entry = {"seq": seq, "op": name, "group": key, "shapes": shapes, "dtypes": dtypes,
                 "where": f"{filename}:{line}", "state": "started", "time": time.time()}
        state.entries.append(entry)
    # written by hand (op, group, dtypes are plain names; shapes lists of ints): no json.dumps
    labels = ", ".join(f'"{label}"' for label in dtypes)
    text = (f'{{"seq": {seq}, "op": "{name}", "group": "{key}", "shapes": {shapes},'
            f' "dtypes": [{labels}], "where": {where}, "state": "started"}}')
    data = text.encode()[: LAST_BYTES - 1]
    try:
        state.last[:] = data.ljust(LAST_BYTES)
    except (OSError, ValueError):  # a map already closed at exit
        pass
    return entry


def _caller() -> tuple[str, int]:
    """(file, line) of the first frame outside torch, devicekit and the stdlib (by install place)."""
    frame = sys._getframe(3)
    while frame is not None:
        filename = frame.f_code.co_filename
        if library_of(filename) is None:
            return filename, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return "?", 0


def _progress() -> int:
    """torch's sequence number of the default group (DDP's all-reduces included); -1 if none."""
    try:
        from torch.distributed import distributed_c10d as c10d

        group = c10d._get_default_group()
        return int(group._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - no group yet, or a torch without it
        return -1


def dump(state: _State, request: str) -> None:
    """Write this rank's record and its Python stacks for the supervisor's ``request``."""
    base = os.path.join(state.directory, f"rank{state.rank}")
    with open(base + ".stack.tmp", "w") as handle:
        faulthandler.dump_traceback(handle, all_threads=True)
    os.replace(base + ".stack.tmp", base + ".stack")
    body = {"request": request, "rank": state.rank, "pid": os.getpid(), "time": time.time(),
            "torch_seq": _progress(), "timeout": state.timeout, "main_stack": _main_stack(),
            "records": records(), "flight_recorder": _flight_recorder()}
    _write(base + ".json", json.dumps(body))


def _main_stack() -> list[list[Any]]:
    """The main thread's Python stack, outermost first: [file, line, function] per frame."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    stack: list[list[Any]] = []
    while frame is not None:
        stack.append([frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name])
        frame = frame.f_back
    return stack[::-1][-60:]


def _flight_recorder() -> dict[str, Any] | None:
    """torch's Flight Recorder status per group (last enqueued/completed), where it records."""
    if not os.environ.get("TORCH_FR_BUFFER_SIZE"):
        return None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        data = json.loads(_dump_fr_trace_json(True, False))
    except Exception:  # noqa: BLE001 - a torch without it, or a backend that does not record
        return None
    entries = data.get("entries") or []
    last = entries[-1] if entries else {}
    # the oldest collective not finished: on NCCL the Python call returns at once and the rank
    # runs ahead, so the collective it waits for is this one, not the last it issued
    pending = next((entry for entry in entries if entry.get("retired") is False), None)
    keys = ("profiling_name", "collective_seq_id", "input_sizes", "input_dtypes", "retired")
    return {"pg_status": data.get("pg_status", {}),
            "last": {key: last.get(key) for key in keys},
            "pending": {key: pending.get(key) for key in keys} if pending else None}


def _exiting(state: _State) -> None:
    """At interpreter exit (the rank's Python code is done): say so, so that a slow exit is not
    taken for a hang and an abort in torch's teardown can be told from a failure."""
    _exited.append(True)  # the probe thread must not overwrite "exiting" afterwards
    last = state.entries[-1] if state.entries else {}
    try:
        _write(os.path.join(state.directory, f"rank{state.rank}.progress"),
               json.dumps({"torch_seq": _progress(), "seq": last.get("seq", 0), "state": "exiting",
                           "op": last.get("op"), "timeout": state.timeout,
                           # clean: no unhandled exception, and not left from inside a collective
                           "clean": not hasattr(sys, "last_value") and last.get("state") != "started"}))
    except OSError:
        pass


def _answer(state: _State) -> None:
    request_path = os.path.join(state.directory, REQUEST_FILE)
    progress_path = os.path.join(state.directory, f"rank{state.rank}.progress")
    seen_request = ""
    last = None
    while True:
        try:
            mark = (_progress(), len(state.entries) and state.entries[-1]["seq"],
                    len(state.entries) and state.entries[-1]["state"])
            if mark != last and not _exited:
                last = mark
                _write(progress_path, json.dumps({"torch_seq": mark[0], "seq": mark[1],
                                                  "state": mark[2], "timeout": state.timeout}))
            request = _read_request(request_path)
            if request and request != seen_request:
                seen_request = request
                dump(state, request)
        except Exception:  # noqa: BLE001, S110 - the probe must never take the rank down
            pass
        time.sleep(POLL_SECONDS)


def _read_request(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            raw = handle.read(32)
    except OSError:
        return ""
    text = raw.decode("ascii", "replace").strip()
    return text if text.isdigit() else ""


def _write(path: str, text: str) -> None:
    """Write ``path`` atomically (a reader never sees half a file)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)
