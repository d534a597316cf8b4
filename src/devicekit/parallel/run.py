"""What ``devicekit run`` does: lease GPUs, build the command line, run it, supervise it.

One process on one node runs the command directly (with torchrun's variables for a world of
one, so a script written for torchrun runs unchanged); several processes or nodes run it under
torchrun (``python -m devicekit.parallel.torchrun_entry``: torchrun's own parser and agent, but
exiting with the failed rank's code instead of 1), which does the rendezvous. The child gets
CUDA_VISIBLE_DEVICES with the leased GPUs' UUIDs and inherits the lease file descriptors, so
the GPUs stay leased until the child itself has exited even if ``devicekit run`` is killed;
the child also gets SIGTERM when ``devicekit run`` dies (no orphans), and descendants it
leaves behind (torchrun starts each rank in its own session) are stopped when it exits. SIGINT, SIGTERM and SIGHUP
sent to ``devicekit run`` are forwarded to the child's process group; the exit code comes back
(128 + N for a child killed by signal N, and for a torchrun job that failed after signal N was
forwarded: torchrun itself would say 1).

Usage::

    from devicekit.parallel.run import RunRequest, run

    code = run(RunRequest(gpus=2, command=["python", "train.py"]))
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from devicekit.errors import CommandNotFoundError, InvalidValueError, LaunchError
from devicekit.hardware.checks import take_inventory
from devicekit.parallel.allocation import Allocation, allocate
from devicekit.parallel.dist import GPUS_PER_PROC_ENV, LOOPBACK_OK_ENV, OWN_DEVICES_ENV
from devicekit.parallel.environments.base import DEFAULT_PORT, check_resolvable, is_loopback
from devicekit.parallel.environments.torchrun import LAUNCH_MARKER, PUBLISHED_MARKER
from devicekit.parallel.threads import omp_threads, usable_cores

__all__ = ["RunRequest", "RunPlan", "plan_run", "execute", "run", "EXAMPLE_COMMAND"]

#: the bundled example, run when no command is given
EXAMPLE_COMMAND = ("-m", "devicekit.examples")
#: after forwarding a signal, how long the child may take before its group is killed
KILL_AFTER_SECONDS = 15.0
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class RunRequest:
    """The ``devicekit run`` flags."""

    command: list[str] = field(default_factory=list)
    gpus: int | str | None = None
    procs: int | None = None
    gpus_per_proc: int = 1
    min_free_memory: int | str | None = None
    wait: float | None = None
    nnodes: int = 1
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None


#: the module ``devicekit run`` starts for several processes or nodes (torchrun underneath)
TORCHRUN_ENTRY = "devicekit.parallel.torchrun_entry"


@dataclass
class RunPlan:
    """What will be started: ``argv`` with ``env``, on ``allocation``; ``notes`` say why."""

    argv: list[str]
    env: dict[str, str]
    allocation: Allocation
    notes: list[str]

    @property
    def distributed(self) -> bool:
        return TORCHRUN_ENTRY in self.argv


def plan_run(request: RunRequest, environ: Mapping[str, str] | None = None) -> RunPlan:
    """Check the flags, lease the GPUs and build the command line (nothing is started yet)."""
    environ = dict(os.environ if environ is None else environ)
    _check_nodes(request)
    allocation = allocate(
        request.gpus,
        request.procs,
        gpus_per_proc=request.gpus_per_proc,
        min_free_memory=request.min_free_memory,
        wait=request.wait,
        command=shlex.join(request.command) if request.command else "devicekit run (example)",
    )
    try:
        _check_torch_can_use(allocation)
        notes = [allocation.reason, *(f"  not chosen: {line}" for line in allocation.rejected)]
        command = _command(request.command)
        env = dict(environ)
        for stale in (LAUNCH_MARKER, OWN_DEVICES_ENV, LOOPBACK_OK_ENV, PUBLISHED_MARKER,
                      "TORCHELASTIC_USE_AGENT_STORE"):
            env.pop(stale, None)  # left by an outer devicekit job: they would mislead the ranks
        env[GPUS_PER_PROC_ENV] = str(request.gpus_per_proc)
        if allocation.on_gpu:
            env["CUDA_VISIBLE_DEVICES"] = allocation.cuda_visible_devices
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            notes.append(f"CUDA_VISIBLE_DEVICES={allocation.cuda_visible_devices}")
        if allocation.nprocs == 1 and request.nnodes == 1:
            # torchrun's variables for a world of one: a script written for torchrun runs as is
            env.update(single_process_variables(_free_port()))
            return RunPlan(command, env, allocation, notes)
        addr = request.master_addr or "127.0.0.1"
        # one node and no port asked for: torchrun binds a free port itself (its c10d
        # rendezvous on localhost:0), so no other process can take it between choice and bind
        port = request.master_port or (DEFAULT_PORT if request.nnodes > 1 else None)
        if request.nnodes > 1 and is_loopback(addr):
            env[LOOPBACK_OK_ENV] = "1"
            notes.append(
                f"master address {addr} is loopback: all {request.nnodes} nodes must run on this"
                " host (a rehearsal); use the master's host name for real machines"
            )
        if allocation.nprocs > 1 and "OMP_NUM_THREADS" not in env:
            # deliberately, instead of torchrun's banner in every run setting it to 1
            threads = omp_threads(allocation.nprocs)
            env["OMP_NUM_THREADS"] = str(threads)
            notes.append(f"OMP_NUM_THREADS={threads} ({usable_cores()} usable cores /"
                         f" {allocation.nprocs} processes; set OMP_NUM_THREADS to choose)")
        argv = [
            sys.executable, "-m", TORCHRUN_ENTRY,  # torchrun, with the ranks' exit codes kept
            "--nnodes", str(request.nnodes),
            "--node-rank", str(request.node_rank or 0),
            "--nproc-per-node", str(allocation.nprocs),
            *(["--master-addr", addr, "--master-port", str(port)] if port is not None else []),
            "--no-python",
            *command,
        ]
        master = f"{addr}:{port}" if port is not None else "this host, a port torchrun picks"
        notes.append(
            f"torchrun: {allocation.nprocs} process(es) on node {request.node_rank or 0} of"
            f" {request.nnodes}, master {master}"
        )
        return RunPlan(argv, env, allocation, notes)
    except BaseException:
        allocation.release()
        raise


def run(request: RunRequest, echo: Callable[[str], None] | None = None) -> int:
    """Plan, say what was chosen (``echo``, stderr by default), run, release; the exit code."""
    echo = echo or (lambda line: print(f"devicekit run: {line}", file=sys.stderr, flush=True))
    plan = plan_run(request)
    try:
        for line in plan.notes:
            echo(line)
        return execute(plan)
    finally:
        plan.allocation.release()


def execute(plan: RunPlan) -> int:
    """Start the plan's command, forward signals to its process group, wait; its exit code."""
    try:
        child = subprocess.Popen(
            plan.argv,
            env=plan.env,
            pass_fds=plan.allocation.lease_fds,
            preexec_fn=_child_setup,  # noqa: PLW1509 - setpgid + parent-death signal, nothing else
        )
    except OSError as exc:
        raise CommandNotFoundError(
            f"cannot start {plan.argv[0]!r}: {exc.strerror}; check the command after '--'"
        ) from None
    with contextlib.suppress(OSError):
        os.setpgid(child.pid, child.pid)  # also from here, so it holds before we signal
    forwarded: list[float] = []
    signals: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(time.monotonic())
        signals.append(signum)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signum)

    # torchrun starts each rank in a session of its own: the ranks are not in the child's
    # process group, so remember the child's descendants to stop any it leaves behind
    family = _Descendants(child.pid)
    ticks = 0
    with _terminal_given_to(child.pid), _handlers(forward):
        while True:
            try:
                code = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                ticks += 1
                if ticks % 5 == 1:
                    family.update()
                if forwarded and time.monotonic() - forwarded[0] > KILL_AFTER_SECONDS:
                    family.update()
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(child.pid, signal.SIGKILL)
    _reap_group(child.pid)
    family.stop_survivors()
    if code < 0:
        return 128 - code
    if signals and code != 0 and plan.distributed:
        # torchrun turns a signal into its own exit code 1 (SignalException): give back the
        # shell's 128 + N for the signal that stopped the job, as for a single process
        return 128 + signals[0]
    return code


def single_process_variables(port: int) -> dict[str, str]:
    """The variables torchrun sets, for one process on one node (rank 0 of 1)."""
    return {
        "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0",
        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        LAUNCH_MARKER: "1", OWN_DEVICES_ENV: "1",
    }


def _check_torch_can_use(allocation: Allocation) -> None:
    """Refuse to lease real GPUs for a torch that cannot use them (CPU build, driver too old).

    Otherwise the job would hold the GPUs while ``dk.dist.device()`` trains on the CPU.
    Simulated GPUs are exempt: there, the CPU is what the job is expected to use.
    """
    if not allocation.on_gpu:
        return
    inventory = take_inventory()
    if inventory.backend != "nvml":
        return
    from devicekit.hardware.torch_checks import check_torch_build

    check = check_torch_build(inventory)
    if check.status == "fail":
        raise LaunchError(
            f"{len(allocation.uuids)} GPU(s) leased but torch cannot use them: {check.message};"
            " nothing started (run 'devicekit doctor' for details)"
        )


def _check_nodes(request: RunRequest) -> None:
    if request.nnodes < 1:
        raise InvalidValueError(f"--nnodes {request.nnodes} must be at least 1")
    if request.nnodes > 1:
        if request.master_addr is None:
            raise InvalidValueError(
                f"--nnodes {request.nnodes} needs --master-addr (the host name of node 0)"
            )
        if request.node_rank is None:
            raise InvalidValueError(
                f"--nnodes {request.nnodes} needs --node-rank (0 to {request.nnodes - 1}) on every node"
            )
    if request.node_rank is not None and not 0 <= request.node_rank < request.nnodes:
        raise InvalidValueError(
            f"--node-rank {request.node_rank} must be between 0 and {request.nnodes - 1}"
        )
    if request.master_port is not None and not 0 < request.master_port < 65536:
        raise InvalidValueError(f"--master-port {request.master_port} is not a TCP port (1-65535)")
    if request.master_addr is not None:  # before any lease: a typo must not wait for a timeout
        check_resolvable(request.master_addr, "--master-addr")


def _command(command: list[str]) -> list[str]:
    if not command:
        return [sys.executable, "-u", *EXAMPLE_COMMAND]
    if command[0].endswith(".py"):
        return [sys.executable, "-u", *command]
    return list(command)


def _free_port() -> int:
    from devicekit.parallel.launch import free_port

    return free_port()


def _child_setup() -> None:
    """In the child before exec: its own process group; SIGTERM when ``devicekit run`` dies."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)


@contextlib.contextmanager
def _handlers(forward: Callable[[int, object], None]) -> Iterator[None]:
    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _terminal_given_to(pgid: int) -> Iterator[None]:
    """Make the child's group the terminal's foreground group so Ctrl-C and pdb reach it."""
    fd = None
    try:
        if sys.stdin is not None and sys.stdin.isatty() and os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp():
            fd = sys.stdin.fileno()
    except (OSError, ValueError):
        fd = None
    if fd is not None:
        with contextlib.suppress(OSError):
            os.tcsetpgrp(fd, pgid)
    try:
        yield
    finally:
        if fd is not None:
            old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # we are in the background now
            try:
                with contextlib.suppress(OSError):
                    os.tcsetpgrp(fd, os.getpgrp())
            finally:
                signal.signal(signal.SIGTTOU, old)


class _Descendants:
    """The child's descendants seen so far, to stop those that outlive it (orphaned ranks)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[int, object] = {}

    def update(self) -> None:
        import psutil

        try:
            for proc in psutil.Process(self.pid).children(recursive=True):
                self.seen.setdefault(proc.pid, proc)
        except psutil.Error:
            pass

    def stop_survivors(self) -> None:
        """SIGTERM every remembered descendant still running, SIGKILL it after a grace period."""
        import psutil

        alive = []
        for proc in self.seen.values():
            try:  # is_running() also checks the start time: a reused pid is not ours
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:  # type: ignore[attr-defined]
                    proc.terminate()  # type: ignore[attr-defined]
                    alive.append(proc)
            except psutil.Error:
                continue
        _, left = psutil.wait_procs(alive, timeout=3.0)
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(left, timeout=1.0)


def _reap_group(pgid: int) -> None:
    """Stop whatever the child left behind in its process group (no orphans)."""
    for sig, pause in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 1.0)):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + pause
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)
