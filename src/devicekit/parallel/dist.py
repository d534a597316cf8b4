"""The rank environment: who am I in this job, set up the process group, and small collectives.

``env()`` reads torchrun, Slurm, MPI, ``dk.launch`` or a plain process; ``init()`` picks nccl on
CUDA (gloo otherwise), binds this rank to *its* GPU (from the local rank and the GPUs the
process was given, never ``local_rank % device_count``), makes the timeout apply, and may be
called twice. Everything below works in a single process without ``init()`` too.

Usage::

    import devicekit as dk

    device = dk.dist.init()                    # torchrun, srun, mpirun, dk.launch or plain python
    model = model.to(device)
    loss = dk.dist.all_reduce_mean(loss.detach())
    dk.dist.print0(f"{dk.dist.env().world_size} ranks, mean loss {loss.item():.3f}")

    @dk.dist.rank_zero_only
    def save(): ...
"""

from __future__ import annotations

import functools
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from devicekit.errors import DistributedError
from devicekit.hardware.launchers import DistEnv, detect_environment, slurm_place
from devicekit.hardware.launchers.base import check_resolvable, is_loopback
from devicekit.hardware.launchers.torchrun import PUBLISHED_MARKER
from devicekit.parallel import collective_log
from devicekit.parallel.clean_exit import exit_without_teardown
from devicekit.teardown import settle_backend_threads

if TYPE_CHECKING:
    import torch

__all__ = [
    "DistEnv",
    "env",
    "init",
    "device",
    "is_initialized",
    "is_main",
    "rank_zero_only",
    "print0",
    "barrier",
    "all_reduce_mean",
    "gather_object",
    "destroy",
    "exit_without_teardown",
    "GPUS_PER_PROC_ENV",
    "OWN_DEVICES_ENV",
    "LOOPBACK_OK_ENV",
    "WorldOfOneWarning",
]

#: set by ``devicekit run`` / ``dk.launch``: GPUs each process drives (model parallel inside DDP)
GPUS_PER_PROC_ENV = "DEVICEKIT_GPUS_PER_PROC"
#: set by ``dk.launch``: CUDA_VISIBLE_DEVICES already holds only this rank's own GPU(s)
OWN_DEVICES_ENV = "DEVICEKIT_OWN_DEVICES"
#: set by ``devicekit run --master-addr 127.0.0.1 --nnodes N``: every "node" runs on this host
LOOPBACK_OK_ENV = "DEVICEKIT_LOOPBACK_OK"

F = TypeVar("F", bound=Callable[..., Any])


def env() -> DistEnv:
    """This process's rank facts from whichever launcher started it (read fresh on each call)."""
    return detect_environment().read()


def is_initialized() -> bool:
    """True once a default process group exists (``init()`` or the user's own)."""
    try:
        import torch.distributed as tdist
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return tdist.is_available() and tdist.is_initialized()


def device(facts: DistEnv | None = None) -> torch.device:
    """The device this rank should use: its own GPU, or the CPU where there is none.

    A process that sees exactly its own GPU(s) (``dk.launch``, Slurm ``--gpus-per-task``) uses
    ``cuda:0``; a process that sees every GPU of its node (torchrun) uses the
    ``local_rank``-th block of ``DEVICEKIT_GPUS_PER_PROC`` (default 1) GPUs. Too few GPUs for
    the ranks on this node is an error, never a silent ``local_rank % device_count``.
    """
    import torch

    facts = facts or env()
    if not torch.cuda.is_available():
        _warn_if_gpus_were_meant(torch)
        return torch.device("cpu")
    count = torch.cuda.device_count()
    per_proc = _gpus_per_proc()
    # Slurm --gpus-per-task / MPI binding hands each task only its own GPU(s); torchrun does not
    bound = facts.source in ("slurm", "mpi") and count == per_proc and facts.local_world_size > 1
    if os.environ.get(OWN_DEVICES_ENV) == "1" or bound:
        return torch.device("cuda", 0)
    needed = facts.local_world_size * per_proc
    if count < needed:
        _check_slurm_tasks(facts, count)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise DistributedError(
            f"local rank {facts.local_rank} has no GPU of its own: {facts.local_world_size}"
            f" process(es) x {per_proc} GPU(s) on this node but this process sees {count}"
            f" (CUDA_VISIBLE_DEVICES={visible}); start at most {count // per_proc} per node"
        )
    return torch.device("cuda", facts.local_rank * per_proc)


class CPUFallbackWarning(UserWarning):
    """This process was given GPUs, but torch cannot use CUDA, so it runs on the CPU."""


def _warn_if_gpus_were_meant(torch: Any) -> None:
    """Say loudly (once) why a process handed GPUs (CUDA_VISIBLE_DEVICES) gets the CPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible or visible == "-1" or os.environ.get("DEVICEKIT_SIMULATE"):
        return  # no GPU was meant (or the GPUs are simulated: the CPU is expected)
    if _warned:
        return
    _warned.append(True)
    cuda = getattr(torch.version, "cuda", None)
    if cuda is None:
        cause = (f"torch {torch.__version__} is a CPU-only build; install a CUDA build"
                 " (pytorch.org/get-started)")
    else:
        cause = (f"torch {torch.__version__} is built for CUDA {cuda} but"
                 " torch.cuda.is_available() is False (a driver too old for that build?);"
                 " run 'devicekit doctor'")
    warnings.warn(f"this process was given GPUs (CUDA_VISIBLE_DEVICES={visible}) but runs on the"
                  f" CPU: {cause}", CPUFallbackWarning, stacklevel=3)


_warned: list[bool] = []


def init(backend: str = "auto", timeout: float | timedelta | None = None) -> torch.device:
    """Create the default process group for this rank and bind it to its device; return it.

    ``backend="auto"`` is nccl where CUDA is usable, gloo otherwise. ``timeout`` (seconds or a
    timedelta; torch's default when None) is passed to ``init_process_group`` and, for nccl,
    asynchronous error handling is switched on so a stuck collective ends the process instead of
    hanging forever. A plain process gets a one-rank group (no network), so DDP code runs
    unchanged. Calling ``init()`` again returns the device without touching the group.
    """
    import torch
    import torch.distributed as tdist

    facts = env()
    if is_initialized():
        return device(facts)
    if facts.source == "single":
        _warn_outside_slurm_step()
    _check_local_rank_argument(facts, sys.argv)
    _check_master_address(facts)
    dev = device(facts)
    if facts.source == "slurm" and dev.type == "cuda":
        _check_slurm_tasks(facts, torch.cuda.device_count())
    name = _resolve_backend(backend, dev)
    span = _as_timedelta(timeout)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if name == "nccl":
        # without it a timed-out nccl collective blocks forever instead of raising
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    _publish_torchrun_variables(facts)
    kwargs: dict[str, Any] = {"backend": name, "rank": facts.rank, "world_size": facts.world_size}
    if span is not None:
        kwargs["timeout"] = span
    if name == "nccl":
        kwargs["device_id"] = dev
    if facts.world_size == 1:
        kwargs["store"] = tdist.HashStore()  # one rank: no port, no network
    else:
        kwargs["init_method"] = f"tcp://{_bracket(facts.master_addr)}:{facts.master_port}"
    collective_log.flight_recorder_for(name)  # NCCL under devicekit run / dk.launch
    try:
        tdist.init_process_group(**kwargs)
    except (RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistributedError(
            f"cannot join the process group at {facts.master_addr}:{facts.master_port} as"
            f" {facts.describe()}: {first}"
        ) from exc

    # under devicekit run / dk.launch: this rank records its collectives for the hang doctor
    collective_log.start_from_environment(facts.rank, collective_log.group_timeout(span, name))
    return dev


class WorldOfOneWarning(UserWarning):
    """``dk.dist.init()`` in a Slurm job of several tasks, but outside any srun step."""


def _warn_outside_slurm_step() -> None:
    """The sbatch script or salloc's shell of a job with several tasks is one process: say so,
    since the user most likely meant ``srun -n N python ...`` (never a silent world of one)."""
    place = slurm_place(os.environ)
    if place.outside_step and place.job_tasks > 1:
        warnings.warn(
            f"dk.dist.init() runs in {place.where} of Slurm job {place.job_id} ({place.job_tasks}"
            " tasks), which is none of its tasks: a world of one; start the ranks with"
            f" 'srun -n {place.job_tasks} python ...' (or 'devicekit run')",
            WorldOfOneWarning, stacklevel=3)


def _publish_torchrun_variables(facts: DistEnv) -> None:
    """Slurm / MPI ranks: set torchrun's variables too, for code that reads LOCAL_RANK & co.,
    marked so that ``env()`` still reads Slurm / MPI (its source, its device binding)."""
    if facts.source not in ("slurm", "mpi"):
        return
    for key, value in (("RANK", facts.rank), ("LOCAL_RANK", facts.local_rank),
                       ("WORLD_SIZE", facts.world_size), ("LOCAL_WORLD_SIZE", facts.local_world_size),
                       ("GROUP_RANK", facts.node_rank), ("GROUP_WORLD_SIZE", facts.nnodes),
                       ("MASTER_ADDR", facts.master_addr), ("MASTER_PORT", facts.master_port)):
        os.environ.setdefault(key, str(value))
    if (os.environ["RANK"], os.environ["WORLD_SIZE"]) == (str(facts.rank), str(facts.world_size)):
        os.environ[PUBLISHED_MARKER] = (
            f"{facts.source}:{os.environ['RANK']}:{os.environ['WORLD_SIZE']}:{os.environ['MASTER_PORT']}")


def destroy() -> None:
    """Tear the default process group down if there is one (safe to call twice), then wait for
    torch's gloo worker threads to settle, so the interpreter's exit cannot abort in them
    (see :mod:`devicekit.teardown`; ``import devicekit`` also waits at exit)."""
    if is_initialized():
        import torch.distributed as tdist

        tdist.destroy_process_group()
    settle_backend_threads()


def is_main() -> bool:
    """True on global rank 0 (of the process group if one exists, else of the environment)."""
    if is_initialized():
        import torch.distributed as tdist

        return tdist.get_rank() == 0
    return env().rank == 0


def rank_zero_only(fn: F) -> F:
    """Decorator: run ``fn`` on rank 0 only; other ranks get ``None`` back."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) if is_main() else None

    return wrapper  # type: ignore[return-value]


def print0(*values: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only (flushed, so output from several ranks does not interleave late)."""
    if is_main():
        kwargs.setdefault("flush", True)
        print(*values, **kwargs)


def barrier() -> None:
    """Wait for every rank; a no-op without a process group or with one rank."""
    if not is_initialized():
        return
    import torch.distributed as tdist

    if tdist.get_world_size() == 1:
        return
    if tdist.get_backend() == "nccl":
        import torch

        tdist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        tdist.barrier()


def all_reduce_mean(value: Any) -> Any:
    """The mean of a tensor (or a number) over all ranks; the input is left untouched.

    Integer tensors are averaged as float64. Without a process group the value comes back as
    it is (a copy for tensors). With nccl, a CPU tensor is an error naming its device.
    """
    import torch

    is_number = not isinstance(value, torch.Tensor)
    tensor = torch.as_tensor(value, dtype=torch.float64) if is_number else value.detach().clone()
    if not tensor.is_floating_point() and not tensor.is_complex():
        tensor = tensor.to(torch.float64)
    if is_initialized():
        import torch.distributed as tdist

        world = tdist.get_world_size()
        if world > 1:
            if is_number and tdist.get_backend() == "nccl":
                tensor = tensor.to(torch.device("cuda", torch.cuda.current_device()))
            _check_collective_device(tensor, "all_reduce_mean")
            tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM)
            tensor /= world
    return tensor.item() if is_number else tensor


def gather_object(obj: Any, dst: int | None = None) -> list[Any] | None:
    """Collect one picklable object from every rank, in rank order.

    ``dst=None`` gives the list to every rank; ``dst=r`` gives it to rank ``r`` only (others
    get ``None``). Without a process group: ``[obj]``.
    """
    if not is_initialized():
        return [obj] if dst in (None, 0) else None
    import torch.distributed as tdist

    world = tdist.get_world_size()
    if dst is not None and not 0 <= dst < world:
        raise DistributedError(f"gather_object dst={dst} is not a rank of this {world}-rank job")
    if dst is None:
        gathered: list[Any] = [None] * world
        tdist.all_gather_object(gathered, obj)
        return gathered
    target: list[Any] | None = [None] * world if tdist.get_rank() == dst else None
    tdist.gather_object(obj, target, dst=dst)
    return target


# ----------------------------------------------------------------------------- checks


def _check_collective_device(tensor: torch.Tensor, what: str) -> None:
    import torch.distributed as tdist

    if tdist.get_backend() == "nccl" and tensor.device.type != "cuda":
        raise DistributedError(
            f"{what} got a tensor on {tensor.device} but the nccl backend only reduces CUDA"
            " tensors; move it with .to(dk.dist.device()) first"
        )


def _check_master_address(facts: DistEnv) -> None:
    if facts.nnodes > 1 and is_loopback(facts.master_addr) and os.environ.get(LOOPBACK_OK_ENV) != "1":
        raise DistributedError(
            f"master address {facts.master_addr!r} is this machine's loopback but the job spans"
            f" {facts.nnodes} nodes ({facts.source}); set MASTER_ADDR to rank 0's host name or IP"
        )
    if facts.world_size > 1:
        check_resolvable(facts.master_addr, f"master address (MASTER_ADDR, from {facts.source})")


_LOCAL_RANK_ARG = re.compile(r"^--local[-_]rank(?:=(.*))?$")


def _check_local_rank_argument(facts: DistEnv, argv: Sequence[str]) -> None:
    """A ``--local-rank`` argument that disagrees with LOCAL_RANK means a launcher mix-up."""
    for i, arg in enumerate(argv[1:], start=1):
        match = _LOCAL_RANK_ARG.match(arg)
        if match is None:
            continue
        raw = match.group(1)
        if raw is None and i + 1 < len(argv):
            raw = argv[i + 1]
        variable = os.environ.get("LOCAL_RANK")
        if variable is not None and raw is not None and raw.strip() != variable.strip():
            raise DistributedError(
                f"{arg.split('=')[0]}={raw} on the command line but LOCAL_RANK={variable}:"
                " torchrun passes the local rank in the LOCAL_RANK variable; read"
                " dk.dist.env().local_rank and drop the argument"
            )
        if variable is None and facts.source == "single" and raw not in (None, "0"):
            raise DistributedError(
                f"{arg.split('=')[0]}={raw} was given but no launcher set RANK/WORLD_SIZE; start"
                " the script with torchrun or `devicekit run`, which set LOCAL_RANK themselves"
            )


def _check_slurm_tasks(facts: DistEnv, visible: int) -> None:
    if facts.source != "slurm" or visible <= 1:
        return
    per_proc = _gpus_per_proc()
    if facts.local_world_size * per_proc > visible:
        raise DistributedError(
            f"Slurm started {facts.local_world_size} tasks on node {facts.node_rank} but each"
            f" sees {visible} GPU(s); use --ntasks-per-node={visible // per_proc} or"
            " --gpus-per-task=1"
        )


def _resolve_backend(backend: str, dev: torch.device) -> str:
    import torch.distributed as tdist

    name = backend.lower()
    if name == "auto":
        return "nccl" if dev.type == "cuda" and tdist.is_nccl_available() else "gloo"
    if name not in ("nccl", "gloo", "mpi", "ucc", "xccl"):
        raise DistributedError(f"backend {backend!r} is unknown; use 'auto', 'nccl' or 'gloo'")
    if name == "nccl" and dev.type != "cuda":
        raise DistributedError(
            "backend 'nccl' needs a CUDA GPU but this rank runs on the CPU; use backend='gloo'"
            " or 'auto'"
        )
    return name


def _as_timedelta(timeout: float | timedelta | None) -> timedelta | None:
    if timeout is None:
        return None
    span = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if span.total_seconds() <= 0:
        raise DistributedError(f"timeout {timeout!r} must be a positive number of seconds")
    return span


def _gpus_per_proc() -> int:
    raw = os.environ.get(GPUS_PER_PROC_ENV, "1")
    try:
        value = int(raw)
    except ValueError:
        raise DistributedError(f"{GPUS_PER_PROC_ENV}={raw!r} is not an integer") from None
    return max(value, 1)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
