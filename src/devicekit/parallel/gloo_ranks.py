"""Run one function in several CPU processes joined by a gloo process group.

This is the small, bounded runner that :func:`devicekit.check_equivalence` uses to execute one
DDP step on ``world_size`` CPU ranks, and that the DDP tests use. It hides every GPU from the
ranks (``CUDA_VISIBLE_DEVICES=""``), picks a free loopback port, sets the variables torchrun
sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...), initialises gloo, and
returns each rank's return value in rank order. For real training jobs use
:func:`devicekit.launch`, which also binds ranks to GPUs and supervises them.

Usage::

    import torch.distributed as dist
    from devicekit.parallel.gloo_ranks import run_gloo_ranks

    def rank_and_size() -> tuple[int, int]:       # must be importable (module level)
        return dist.get_rank(), dist.get_world_size()

    run_gloo_ranks(rank_and_size, world_size=2, timeout=30)   # [(0, 2), (1, 2)]

A rank that raises stops the others and re-raises as :class:`devicekit.RankFailedError` with
that rank's traceback; ranks still running after ``timeout`` seconds are killed and named in a
:class:`devicekit.RankHangError`.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from devicekit.errors import InvalidValueError, LaunchError, RankFailedError, RankHangError

__all__ = ["run_gloo_ranks", "free_port"]

#: after the first rank reports an error, how long to wait for the others' reports
_GRACE_SECONDS = 2.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(rank: int, world_size: int, port: int, timeout: float, payload: bytes,
               results: Any, hide_gpus: bool) -> None:
    """Entry point of one rank (runs in the spawned child)."""
    if hide_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
    })
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # ranks share the machine's cores
        fn, args, kwargs = pickle.loads(payload)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        try:
            value = fn(*args, **kwargs)
        except BaseException:
            # Report (and time-stamp) before tearing the group down: the teardown makes the
            # peers' collectives fail, and the parent blames the earliest error.
            results.put((rank, "error", traceback.format_exc(), time.time()))
            dist.destroy_process_group()
            return
        dist.destroy_process_group()
        buffer = io.BytesIO()
        torch.save(value, buffer)  # plain bytes: no shared-memory handles outlive this process
        results.put((rank, "ok", buffer.getvalue(), time.time()))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, "error", traceback.format_exc(), time.time()))


def _stop(processes: list[Any]) -> None:
    """Terminate, then kill, every process still alive; reap them all."""
    started = [proc for proc in processes if proc.pid is not None]
    for proc in started:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 3.0
    for proc in started:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)


def run_gloo_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2,
                   timeout: float = 60.0, hide_gpus: bool = True, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo CPU ranks; return values in rank order.

    ``hide_gpus=False`` leaves CUDA visible (gloo can all-reduce CUDA tensors too), for GPU
    tests that want several ranks without NCCL or without one GPU per rank.

    ``fn`` and its arguments must be picklable (a module-level function, not a lambda), because
    each rank is a fresh ``spawn``-ed interpreter. Return values travel back through
    ``torch.save``, so tensors, dicts and numbers all work.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise InvalidValueError(f"world_size={world_size!r} must be a positive integer")
    if timeout <= 0:
        raise InvalidValueError(f"timeout={timeout!r} must be a positive number of seconds")
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as err:
        raise InvalidValueError(
            f"cannot send {getattr(fn, '__qualname__', fn)!r} and its arguments to worker "
            f"processes ({err}); use a module-level function and picklable arguments"
        ) from None

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    processes = [ctx.Process(target=_rank_main, name=f"devicekit-rank-{rank}", daemon=True,
                             args=(rank, world_size, port, timeout, payload, results,
                                   hide_gpus))
                 for rank in range(world_size)]
    values: dict[int, Any] = {}
    errors: dict[int, tuple[float, str, str]] = {}  # rank -> (when, summary, traceback)
    deadline = time.monotonic() + timeout
    grace_end: float | None = None
    try:
        for proc in processes:
            proc.start()
        while len(values) + len(errors) < world_size:
            if grace_end is not None and time.monotonic() > grace_end:
                break
            try:
                rank, status, data, when = results.get(timeout=0.1)
            except queue_module.Empty:
                for rank, proc in enumerate(processes):
                    if (rank not in values and rank not in errors and proc.exitcode is not None
                            and proc.exitcode != 0):
                        errors[rank] = (time.time(), f"rank {rank} exited with code "
                                        f"{proc.exitcode} before returning", "")
                if time.monotonic() > deadline and not errors:
                    stuck = [r for r in range(world_size) if r not in values]
                    raise RankHangError(
                        f"rank(s) {stuck} did not finish within {timeout:g} s; raise timeout= "
                        f"if the step is just slow", stuck_ranks=stuck, stacks={}) from None
            else:
                if status == "ok":
                    import torch

                    values[rank] = torch.load(io.BytesIO(data), weights_only=False)
                    continue
                last_line = data.strip().splitlines()[-1] if data.strip() else "error"
                errors[rank] = (when, f"rank {rank} raised: {last_line}", data)
            if errors and grace_end is None:
                # a failing rank makes its peers' collectives fail a moment later: wait briefly
                # for every report, then blame the earliest
                grace_end = time.monotonic() + _GRACE_SECONDS
        if errors:
            rank = min(errors, key=lambda r: errors[r][0])
            _, summary, text = errors[rank]
            raise RankFailedError(summary, rank, text)
    except (RankFailedError, RankHangError, InvalidValueError):
        raise
    except Exception as err:
        raise LaunchError(f"could not run {world_size} gloo rank(s): {err}") from err
    finally:
        _stop(processes)
        results.close()
        results.join_thread()
    return [values[rank] for rank in range(world_size)]
