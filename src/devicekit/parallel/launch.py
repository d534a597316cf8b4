"""``dk.launch``: run a function on many processes (one per leased GPU, or N CPU ranks) and supervise them.

Each rank gets the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT on a free port) and CUDA_VISIBLE_DEVICES naming only its own leased
GPU(s); the process group is created for it (nccl on CUDA, gloo otherwise) unless
``backend=None``. The return values come back in rank order. When a rank raises, the others
are stopped within seconds and :class:`RankFailedError` carries the rank and its traceback;
with ``timeout``, ranks that have not returned in time have their Python stacks dumped and
:class:`RankHangError` names them. Ranks die with the parent, so none is ever orphaned.

Usage::

    import devicekit as dk

    def train(steps):
        device = dk.dist.device()              # this rank's own GPU, or the CPU
        ...
        return final_loss

    if __name__ == "__main__":                 # needed: ranks re-import this file (spawn)
        losses = dk.launch(train, 100, nprocs=2, timeout=600)
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import re
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for
from typing import Any

from devicekit.errors import LaunchError, RankFailedError, RankHangError
from devicekit.parallel.allocation import Allocation, allocate
from devicekit.parallel.dist import GPUS_PER_PROC_ENV, OWN_DEVICES_ENV
from devicekit.parallel.environments.torchrun import LAUNCH_MARKER
from devicekit.parallel.rank_process import STACK_SIGNAL, rank_main

__all__ = ["launch", "free_port", "STOP_GRACE_SECONDS"]

#: after SIGTERM, how long a rank may take to exit before it is killed
STOP_GRACE_SECONDS = 3.0
#: ranks that have not started (interpreter up, function unpickled) by then count as hung
STARTUP_SECONDS = 120.0
#: after asking for stacks, the longest to wait for ranks to write them
STACK_WAIT_SECONDS = 1.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int | None = None,
    backend: str | None = "auto",
    timeout: float | None = None,
    gpus_per_proc: int = 1,
    min_free_memory: int | str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank; return each rank's value, in rank order.

    ``nprocs``: processes to start. With GPUs, the default is one per GPU that passes the
    filters (each leased, ``gpus_per_proc`` per process); without a GPU it is 1, and
    ``nprocs=N`` starts N CPU ranks on gloo. ``backend``: ``"auto"`` (nccl on CUDA, gloo
    otherwise), a backend name, or None to leave the process group to ``fn``. ``timeout``:
    seconds the whole job may take before the hang watchdog fires. ``fn`` and its arguments
    must be picklable (a module-level function), and the calling script needs the
    ``if __name__ == "__main__":`` guard.
    """
    if timeout is not None and timeout <= 0:
        raise LaunchError(f"timeout={timeout!r} must be a positive number of seconds")
    gpus: int | str | None = None if nprocs is None else nprocs * gpus_per_proc
    allocation = _allocate(gpus, nprocs, gpus_per_proc, min_free_memory)
    try:
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise LaunchError(
                f"cannot send {getattr(fn, '__qualname__', fn)!r} and its arguments to the ranks"
                f" ({exc}); use a module-level function and picklable arguments"
            ) from None
        return _Job(allocation, payload, backend, timeout).run()
    finally:
        allocation.release()


def _allocate(gpus: int | str | None, nprocs: int | None, per_proc: int, min_free: Any) -> Allocation:
    from devicekit.hardware.inventory import gpus as inventory_gpus

    if not inventory_gpus():
        return allocate(None, nprocs, gpus_per_proc=per_proc)
    return allocate("all" if gpus is None else gpus, None, gpus_per_proc=per_proc,
                    min_free_memory=min_free)


class _Job:
    """The running ranks of one ``launch`` call and their supervision."""

    def __init__(self, allocation: Allocation, payload: bytes, backend: str | None,
                 timeout: float | None) -> None:
        self.allocation = allocation
        self.payload = payload
        self.backend = backend
        self.timeout = timeout
        self.world = allocation.nprocs
        self.workdir = tempfile.mkdtemp(prefix="devicekit-launch-")
        self.procs: list[Any] = []
        self.conns: dict[Any, int] = {}
        self.results: dict[int, Any] = {}
        self.ready: set[int] = set()

    def variables(self, rank: int, port: int) -> dict[str, str]:
        world = str(self.world)
        env = {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world, "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            LAUNCH_MARKER: "1", GPUS_PER_PROC_ENV: str(self.allocation.gpus_per_proc),
        }
        if self.allocation.on_gpu:
            env["CUDA_VISIBLE_DEVICES"] = self.allocation.visible_devices(rank)
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env[OWN_DEVICES_ENV] = "1"
        return env

    def stack_path(self, rank: int) -> str:
        return os.path.join(self.workdir, f"rank{rank}.stack")

    def run(self) -> list[Any]:
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        try:
            for rank in range(self.world):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=rank_main,
                    args=(self.payload, self.variables(rank, port), writer, self.stack_path(rank),
                          os.getpid(), self.backend),
                    name=f"devicekit-rank{rank}",
                    daemon=False,
                )
                proc.start()
                writer.close()
                self.procs.append(proc)
                self.conns[reader] = rank
            self.supervise()
            return [self.results[rank] for rank in range(self.world)]
        finally:
            self.stop()
            for conn in self.conns:
                conn.close()
            shutil.rmtree(self.workdir, ignore_errors=True)

    def supervise(self) -> None:
        """Wait for every rank's result; fail fast on an error or a death; fire the watchdog.

        The ``timeout`` clock starts once every rank has started (its interpreter and imports
        are up), so a slow machine does not count against the job; ranks that do not even start
        within ``max(timeout, STARTUP_SECONDS)`` are reported as hung too.
        """
        start = time.monotonic()
        startup_deadline = start + max(self.timeout or 0.0, STARTUP_SECONDS)
        deadline: float | None = None
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        open_conns = dict(self.conns)
        while len(self.results) < self.world:
            if self.timeout is None:
                limit = None
            elif len(self.ready) < self.world:
                limit = startup_deadline
            else:
                deadline = deadline or time.monotonic() + self.timeout
                limit = deadline
            left = None if limit is None else limit - time.monotonic()
            if left is not None and left <= 0:
                self.hang(started=deadline is not None)
            ready = wait_for(list(open_conns) + list(sentinels), timeout=left)
            for item in ready:
                if item in open_conns:
                    rank = open_conns[item]
                    try:
                        message = item.recv()
                    except (EOFError, OSError):
                        open_conns.pop(item)
                        continue  # died before reporting: the sentinel tells how
                    if message[0] != "ready":
                        open_conns.pop(item)
                    self.receive(rank, message)
                elif item in sentinels:
                    rank = sentinels.pop(item)
                    self.reap(rank, open_conns)

    def receive(self, rank: int, message: tuple[Any, ...]) -> None:
        if message[0] == "ready":
            self.ready.add(rank)
            return
        if message[0] == "ok":
            self.results[rank] = message[1]
            return
        _, summary, text = message
        raise RankFailedError(f"rank {rank} of {self.world} failed: {summary}", rank, text)

    def reap(self, rank: int, open_conns: dict[Any, int]) -> None:
        """A rank exited: collect a result still in its pipe, or report how it died."""
        for conn, owner in list(open_conns.items()):
            while owner == rank and rank not in self.results and conn.poll(0):
                try:
                    self.receive(rank, conn.recv())
                except (EOFError, OSError):
                    break
            if owner == rank:
                open_conns.pop(conn)
        if rank in self.results:
            return
        self.procs[rank].join(timeout=5)  # the sentinel closes a moment before the exit status exists
        code = self.procs[rank].exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            how = f"signal {signal.Signals(-code).name}"
        raise RankFailedError(f"rank {rank} of {self.world} died with {how} before returning", rank)

    def hang(self, started: bool) -> None:
        stuck = [rank for rank in range(self.world) if rank not in self.results]
        if not started:
            stuck = [rank for rank in stuck if rank not in self.ready] or stuck
        for rank in stuck:
            proc = self.procs[rank]
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, STACK_SIGNAL)
                except ProcessLookupError:
                    pass
        until = time.monotonic() + STACK_WAIT_SECONDS
        stacks = {rank: _read(self.stack_path(rank)) for rank in stuck}
        while time.monotonic() < until and not all(_complete(text) for text in stacks.values()):
            time.sleep(0.05)
            stacks = {rank: _read(self.stack_path(rank)) for rank in stuck}
        waiting = [r for r in stuck if "torch/distributed" in stacks[r]]
        culprits = [r for r in stuck if r not in waiting] or stuck
        detail = ""
        if waiting and culprits != stuck:
            detail = f"; ranks {waiting} wait in a collective for rank(s) {culprits}"
        where = "".join(
            f"; rank {r} at {_innermost_frame(stacks[r])}" for r in culprits if _innermost_frame(stacks[r])
        )
        what = f"did not finish within {self.timeout:g} s" if started else (
            f"did not start within {max(self.timeout or 0.0, STARTUP_SECONDS):g} s")
        message = (
            f"rank(s) {culprits} {what}{where}{detail};"
            " their Python stacks are in RankHangError.stacks"
        )
        raise RankHangError(message, culprits, stacks)

    def stop(self) -> None:
        """SIGTERM every rank still alive (and its children), then SIGKILL after a grace period."""
        import psutil

        alive = [p for p in self.procs if p.is_alive()]
        if not alive:
            return
        family: list[psutil.Process] = []
        for proc in alive:
            try:
                parent = psutil.Process(proc.pid)
                family.extend(parent.children(recursive=True))
                family.append(parent)
            except psutil.NoSuchProcess:
                continue
        for member in family:
            try:
                member.terminate()
            except psutil.NoSuchProcess:
                pass
        _, survivors = psutil.wait_procs(family, timeout=STOP_GRACE_SECONDS)
        for member in survivors:
            try:
                member.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(survivors, timeout=STOP_GRACE_SECONDS)
        for proc in self.procs:
            proc.join(timeout=0.1)


def _innermost_frame(stack: str) -> str:
    """``file:line in function`` of the innermost frame of the main thread in a faulthandler dump."""
    lines = stack.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    for line in lines[(start or 0) + 1 :]:
        match = re.match(r'\s*File "(.+)", line (\d+) in (\S+)', line)
        if match:
            return f"{os.path.basename(match.group(1))}:{match.group(2)} in {match.group(3)}"
    return ""


def _complete(stack: str) -> bool:
    """True once a faulthandler dump has reached the main thread's outermost frame."""
    return "Current thread" in stack and stack.rstrip().endswith("in <module>")


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""
