"""``dk.launch``: run a function on many processes (one per leased GPU, or N CPU ranks) and supervise them.

Each rank gets the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT on a free port) and CUDA_VISIBLE_DEVICES naming only its own leased
GPU(s); the process group is created for it (nccl on CUDA, gloo otherwise) unless
``backend=None``. ``devices="cpu"`` runs N gloo CPU ranks even on a GPU machine (GPUs hidden,
nothing leased); ``devices="visible"`` lets every rank see the caller's GPUs without leasing
them, as torchrun does. The return values come back in rank order, copied by value (tensors
included). When a rank raises, the others are stopped within seconds and
:class:`RankFailedError` names the rank that failed first (not a peer whose collective broke
because of it) with its traceback; with ``timeout``, ranks that have not returned in time have
their Python stacks dumped and :class:`RankHangError` names them. Ranks die with the parent,
so none is ever orphaned.
Inside another launcher's world of several ranks (``srun -n 2``, torchrun, mpirun) it refuses
(:func:`devicekit.jobs.outer.refuse_nested_world`): each rank would start a world of its own.

Usage::

    import devicekit as dk

    def train(steps):
        device = dk.dist.device()              # this rank's own GPU, or the CPU
        ...
        return final_loss

    if __name__ == "__main__":                 # needed: ranks re-import this file (spawn)
        losses = dk.launch(train, 100, nprocs=2, timeout=600)
        grads = dk.launch(step, nprocs=2, devices="cpu", timeout=60)   # CPU ranks on any machine
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait as wait_for
from typing import Any

from devicekit.errors import InvalidValueError, LaunchError, RankFailedError, RankHangError
from devicekit.hardware.launchers.torchrun import LAUNCH_MARKER
from devicekit.jobs.allocation import Allocation, devices_mode, plan_processes, positive_count
from devicekit.jobs.hang_report import (
    DEFAULT_HANG_TIMEOUT,
    FLIGHT_RECORDER_ENTRIES,
    FLIGHT_RECORDER_ENV,
    HANG_DIR_ENV,
    HangWatch,
    diagnose,
)
from devicekit.jobs.outer import refuse_nested_world
from devicekit.jobs.rank_process import STACK_SIGNAL, rank_main
from devicekit.jobs.rank_stacks import complete, in_collective, innermost_frame, read_text
from devicekit.jobs.run_doctor import TORCH_DUMP_ENVS, TORCH_DUMP_PREFIX
from devicekit.jobs.threads import omp_threads
from devicekit.parallel.dist import GPUS_PER_PROC_ENV, OWN_DEVICES_ENV

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


def _host_store(world: int) -> Any:
    """A TCPStore served by this process on a port the OS picked, or None without torch.distributed."""
    try:
        from torch.distributed import TCPStore, is_available
    except ImportError:
        return None
    if not is_available():
        return None
    return TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int | None = None,
    devices: str = "auto",
    backend: str | None = "auto",
    timeout: float | None = None,
    gpus_per_proc: int = 1,
    min_free_memory: int | str | None = None,
    hang_timeout: float | None = DEFAULT_HANG_TIMEOUT,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank; return each rank's value, in rank order.

    ``nprocs``: processes to start (default below). ``devices``:

    - ``"auto"``: with GPUs, lease ``gpus_per_proc`` per process that pass the filters
      (default: one process per such GPU) and show each rank only its own; without a GPU,
      ``nprocs`` (default 1) CPU ranks on gloo.
    - ``"cpu"``: ``nprocs`` (default 1) CPU ranks on gloo even on a GPU machine: CUDA is
      hidden from them and nothing is leased (tests, gradient checks, CPU-only work).
    - ``"visible"``: nothing leased; every rank sees the GPUs this process sees (default: one
      rank per ``gpus_per_proc`` of them) and ``dk.dist.device()`` gives rank ``r`` the
      ``r``-th, as under torchrun. For GPUs you already own, or ranks that share a GPU.

    ``backend``: ``"auto"`` (nccl on CUDA, gloo otherwise), a backend name, or None to leave
    the process group to ``fn``. ``timeout``: seconds the job may take, once every rank has
    started, before the hang watchdog fires. ``hang_timeout``: seconds in which no rank makes
    progress while one waits in a collective (or 3/4 of the process group's timeout, if
    shorter) before the job counts as hung; None switches that off. Either way a hang raises
    :class:`RankHangError` with a report naming the rank to look at. ``min_free_memory`` filters the GPUs to lease
    (``devices="auto"`` only). With several ranks and no ``OMP_NUM_THREADS`` of yours, each
    rank gets ``OMP_NUM_THREADS`` = usable cores / ranks (at least 1), so ranks do not fight
    over the cores. ``fn`` and its arguments must be picklable (a module-level function), and
    the calling script needs the ``if __name__ == "__main__":`` guard.
    """
    for name, value in (("timeout", timeout), ("hang_timeout", hang_timeout)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value <= 0):
            raise InvalidValueError(f"{name}={value!r} must be a positive number of seconds")
    mode = devices_mode(devices, gpus_per_proc, min_free_memory)
    if nprocs is not None:
        positive_count(nprocs, "nprocs")
    refuse_nested_world(f"dk.launch(nprocs={nprocs})" if nprocs else "dk.launch()")
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise InvalidValueError(
            f"cannot send {getattr(fn, '__qualname__', fn)!r} and its arguments to the ranks"
            f" ({exc}); use a module-level function and picklable arguments"
        ) from None
    allocation = plan_processes(mode, nprocs, gpus_per_proc, min_free_memory)
    try:
        return _Job(allocation, payload, backend, timeout, hide_gpus=mode == "cpu",
                    hang_timeout=hang_timeout).run()
    finally:
        allocation.release()


class _Job:
    """The running ranks of one ``launch`` call and their supervision."""

    def __init__(self, allocation: Allocation, payload: bytes, backend: str | None,
                 timeout: float | None, hide_gpus: bool = False,
                 hang_timeout: float | None = None) -> None:
        self.allocation = allocation
        self.hide_gpus = hide_gpus
        self.payload = payload
        self.backend = backend
        self.timeout = timeout
        self.world = allocation.nprocs
        self.workdir = tempfile.mkdtemp(prefix="devicekit-launch-")
        self.hang_dir = os.path.join(self.workdir, "collectives")  # the ranks' records
        os.mkdir(self.hang_dir)
        self.watch = HangWatch(self.hang_dir, self.world, hang_timeout) if hang_timeout else None
        self.procs: list[Any] = []
        self.conns: dict[Any, int] = {}
        self.results: dict[int, Any] = {}
        self.ready: set[int] = set()
        #: rank -> (when it failed, one-line message, traceback) for ranks that failed
        self.failures: dict[int, tuple[float, str, str]] = {}

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
        elif self.hide_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""
        if self.backend is not None:  # the ranks record their collectives (dk.dist.init)
            env[HANG_DIR_ENV] = self.hang_dir
            env[FLIGHT_RECORDER_ENV] = FLIGHT_RECORDER_ENTRIES  # NCCL groups only
            if not any(os.environ.get(name) for name in TORCH_DUMP_ENVS):
                # torch's own default is a predictable /tmp name another user can plant
                for name in TORCH_DUMP_ENVS:
                    env[name] = os.path.join(self.workdir, TORCH_DUMP_PREFIX)
        if self.world > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(omp_threads(self.world))
        return env

    def stack_path(self, rank: int) -> str:
        return os.path.join(self.workdir, f"rank{rank}.stack")

    def run(self) -> list[Any]:
        ctx = multiprocessing.get_context("spawn")
        try:
            # the parent hosts the rendezvous store on a port it has bound (torchrun's agent
            # store): no window in which another process could take a port chosen for rank 0
            store = _host_store(self.world)
            port = store.port if store is not None else free_port()
            self.start(ctx, port, agent_store=store is not None)
            self.supervise()
            return [self.results[rank] for rank in range(self.world)]
        finally:
            self.stop()
            for conn in self.conns:
                conn.close()
            shutil.rmtree(self.workdir, ignore_errors=True)

    def start(self, ctx: Any, port: int, *, agent_store: bool = False) -> None:
        try:
            for rank in range(self.world):
                reader, writer = ctx.Pipe(duplex=False)
                variables = self.variables(rank, port)
                if agent_store:  # every rank connects to the parent's store as a client
                    variables["TORCHELASTIC_USE_AGENT_STORE"] = "True"
                proc = ctx.Process(
                    target=rank_main,
                    args=(self.payload, variables, writer, self.stack_path(rank),
                          os.getpid(), self.backend),
                    name=f"devicekit-rank{rank}",
                    daemon=False,
                )
                # the spawned interpreter inherits os.environ at exec: set the rank's variables
                # there, not only in rank_main, which runs after spawn has re-imported the
                # caller's __main__ (a module-level torch.cuda.is_available() there would fix
                # CUDA's view of the GPUs before CUDA_VISIBLE_DEVICES names the rank's own)
                with _environment(variables):
                    proc.start()
                writer.close()
                self.procs.append(proc)
                self.conns[reader] = rank
        except OSError as exc:  # out of processes, file descriptors or memory
            raise LaunchError(
                f"could not start rank {len(self.procs)} of {self.world} ({exc}); free some"
                " resources or start fewer processes (nprocs=)"
            ) from exc

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
            if self.watch is not None:
                left = 0.5 if left is None else min(left, 0.5)
            ready = wait_for(list(open_conns) + list(sentinels), timeout=left)
            self.handle(ready, open_conns, sentinels)
            if self.watch is not None and not self.failures and self.watch.hung():
                self.hang(started=True, stalled=True)
            if self.failures:
                # a failing rank makes its peers' collectives fail a moment later: take in
                # everything that has already happened, then blame the rank that failed first
                while ready := wait_for(list(open_conns) + list(sentinels), timeout=0):
                    self.handle(ready, open_conns, sentinels)
                self.blame()

    def handle(self, ready: list[Any], open_conns: dict[Any, int], sentinels: dict[Any, int]) -> None:
        for item in ready:
            if item in open_conns:
                rank = open_conns[item]
                try:
                    data = item.recv_bytes()
                except (EOFError, OSError):
                    open_conns.pop(item)
                    continue  # died before reporting: the sentinel tells how
                message = self.load(rank, data)
                if message[0] != "ready":
                    open_conns.pop(item)
                self.receive(rank, message)
            elif item in sentinels:
                rank = sentinels.pop(item)
                self.reap(rank, open_conns)

    def load(self, rank: int, data: bytes) -> tuple[Any, ...]:
        """A rank's message; results are plain pickles (by value: nothing outlives the rank)."""
        try:
            return pickle.loads(data)
        except Exception as exc:  # noqa: BLE001 - e.g. a class only the rank can import
            return ("error", f"rank {rank} returned a value that cannot be loaded here:"
                    f" {type(exc).__name__}: {exc}", traceback.format_exc(), time.time())

    def receive(self, rank: int, message: tuple[Any, ...]) -> None:
        if message[0] == "ready":
            self.ready.add(rank)
            return
        if message[0] == "ok":
            self.results[rank] = message[1]
            return
        _, summary, text, when = message
        self.failures[rank] = (when, f"rank {rank} of {self.world} failed: {summary}", text)

    def blame(self) -> None:
        """Raise for the first rank to fail, preferring failures outside torch.distributed: a
        collective that breaks because a peer died or raised is the consequence, not the cause."""
        def order(rank: int) -> tuple[bool, float]:
            when, _, text = self.failures[rank]
            return in_collective(text), when

        rank = min(self.failures, key=order)
        _, message, text = self.failures[rank]
        if self.backend is not None:  # e.g. gloo aborts a rank on a shape mismatch: say so
            mismatches = diagnose(self.hang_dir, self.world, "dk.launch", wait=2.0).mismatches
            message += "".join(f"; {line}" for line in mismatches)
        raise RankFailedError(message, rank, text)

    def reap(self, rank: int, open_conns: dict[Any, int]) -> None:
        """A rank exited: collect a result still in its pipe, or report how it died."""
        for conn, owner in list(open_conns.items()):
            while owner == rank and rank not in self.results and conn.poll(0):
                try:
                    self.receive(rank, self.load(rank, conn.recv_bytes()))
                except (EOFError, OSError):
                    break
            if owner == rank:
                open_conns.pop(conn)
        if rank in self.results or rank in self.failures:
            return
        self.procs[rank].join(timeout=5)  # the sentinel closes a moment before the exit status exists
        code = self.procs[rank].exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            how = f"signal {signal.Signals(-code).name}"
        self.failures[rank] = (time.time(), f"rank {rank} of {self.world} died with {how} before"
                                " returning", "")

    def hang(self, started: bool, stalled: bool = False) -> None:
        # the ranks' own answer first (their collectives, where each one is), then the stacks
        report = diagnose(self.hang_dir, self.world, "dk.launch") if self.backend and started else None
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
        stacks = {rank: read_text(self.stack_path(rank)) for rank in stuck}
        while time.monotonic() < until and not all(complete(text) for text in stacks.values()):
            time.sleep(0.05)
            stacks = {rank: read_text(self.stack_path(rank)) for rank in stuck}
        waiting = [r for r in stuck if "torch/distributed" in stacks[r]]
        culprits = [r for r in stuck if r not in waiting] or stuck
        if report is not None and report.answered:
            culprits = report.culprits
        detail = ""
        if waiting and culprits != stuck:
            detail = f"; ranks {waiting} wait in a collective for rank(s) {culprits}"
        where = "".join(f"; rank {r} at {innermost_frame(stacks.get(r, ''))}"
                        for r in culprits if innermost_frame(stacks.get(r, "")))
        if stalled and self.watch is not None:
            what = f"made no progress for {self.watch.limit(self.watch.progress()):g} s"
        elif started:
            what = f"did not finish within {self.timeout:g} s"
        else:
            what = f"did not start within {max(self.timeout or 0.0, STARTUP_SECONDS):g} s"
        if report is not None and report.answered:
            verdict = report.lines[-1].split(": ", 1)[-1]
            raise RankHangError(f"rank(s) {culprits} {what}{where}; {verdict}; the report is in"
                                " RankHangError.report, stacks in .stacks", culprits, stacks,
                                report.text)
        message = (
            f"rank(s) {culprits} {what}{where}{detail};"
            " their Python stacks are in RankHangError.stacks"
        )
        raise RankHangError(message, culprits, stacks)

    def stop(self) -> None:
        """SIGTERM every rank still alive (and its children), then SIGKILL after a grace period.

        The ranks themselves are stopped and reaped through multiprocessing (a rank reaped
        behind its back would stay "alive" in ``multiprocessing.active_children()`` for
        ever); their own children (data-loader workers, ...) through psutil.
        """
        import psutil

        alive = [p for p in self.procs if p.is_alive()]
        if not alive:
            return
        family: list[psutil.Process] = []
        for proc in alive:
            try:
                family.extend(psutil.Process(proc.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        for member in family:
            try:
                member.terminate()
            except psutil.NoSuchProcess:
                pass
        for proc in alive:
            proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for proc in alive:
            proc.join(max(0.0, deadline - time.monotonic()))
        _, survivors = psutil.wait_procs(family, timeout=max(0.0, deadline - time.monotonic()))
        for member in survivors:
            try:
                member.kill()
            except psutil.NoSuchProcess:
                pass
        for proc in alive:
            if proc.is_alive():
                proc.kill()
                proc.join(STOP_GRACE_SECONDS)
        psutil.wait_procs(survivors, timeout=STOP_GRACE_SECONDS)


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``variables`` inside the block, restored after it."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
