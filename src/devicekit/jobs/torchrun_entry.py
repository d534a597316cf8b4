"""torchrun, with the failed rank's exit code passed through: what ``devicekit run`` starts.

Plain torchrun (``python -m torch.distributed.run``) exits 1 and prints its own traceback when a
rank fails, so a shell script or a Slurm requeue cannot tell ``exit 7`` from a crash of the
launcher. This entry point runs torchrun itself (its own ``parse_args`` and ``run``: same flags,
same rendezvous, same agent) and exits with the exit code of the rank that failed first (128+N
when a signal N killed it), after one line that says which rank it was.

Usage::

    python -m devicekit.jobs.torchrun_entry --nproc-per-node 2 --no-python sh -c 'exit 7'
    echo $?   # 7
"""

from __future__ import annotations

import sys

__all__ = ["main", "exit_code_of"]


def exit_code_of(exitcode: int) -> int:
    """A shell's exit code for a process's: 128+N for death by signal N, never 0 for a failure."""
    if exitcode < 0:
        return 128 - exitcode
    return exitcode or 1


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; 0, or the exit code of the first rank that failed."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from devicekit.jobs.preempt_signals import agent_survives_warnings

    agent_survives_warnings()  # Slurm's SIGUSR1 reaches every process of a step
    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = exit_code_of(failure.exitcode)
        how = (f"was killed by signal {-failure.exitcode} ({failure.signal_name()})"
               if failure.exitcode < 0 else f"exited with code {failure.exitcode}")
        print(f"devicekit run: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) "
              f"{how} first; exiting {code}", file=sys.stderr, flush=True)
        after = finished_note(rank, failure.exitcode)
        if after:
            print(f"devicekit run: {after}", file=sys.stderr, flush=True)
        return code
    except SignalException as exc:  # devicekit run forwarded a signal: the shell's 128 + N
        return 128 + int(exc.sigval)
    return 0


def finished_note(rank: int, exitcode: int) -> str:
    """A plain sentence when a rank died of a signal after its Python code had finished."""
    import os

    from devicekit.jobs.hang_report import HANG_DIR_ENV, finished_state

    directory = os.environ.get(HANG_DIR_ENV)
    state = finished_state(directory, rank) if directory and exitcode < 0 else None
    if state is None:
        return ""
    last = f" (seq {state['seq']}, {state['op']})" if state.get("op") else ""
    return (f"rank {rank} had finished its Python code, after its last collective{last}: it was"
            " killed in torch's teardown at interpreter exit, not by an error of the job (a known"
            " torch problem, pytorch/pytorch#190489 and #179291; end the script with"
            " dk.dist.exit_without_teardown(0) after dk.dist.destroy())")


if __name__ == "__main__":
    from devicekit.parallel.clean_exit import exit_without_teardown

    exit_without_teardown(main())  # torchrun's agent (the store's host) cannot abort at exit
