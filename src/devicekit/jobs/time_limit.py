"""``devicekit run --time``: the job's time limit, enforced on its whole process group.

At the limit the job's process group gets SIGTERM; whatever is left after the grace period
(``time_limit_grace`` in the queue policy, default 10 s) gets SIGKILL. ``devicekit run`` then
says so on stderr and exits with the shell's code for the signal (143 for SIGTERM, 137 for
SIGKILL). The limit is measured on the monotonic clock: setting the wall clock moves nothing.
A declared limit is also what lets a queued job be backfilled onto GPUs reserved for an
earlier, larger job (:mod:`devicekit.sharing.queue_order`).

Usage::

    from devicekit.jobs.time_limit import TimeLimit

    limit = TimeLimit(seconds=1800, grace=10)
    limit.start()
    while job_runs():
        limit.check(pgid)          # SIGTERM at the limit, SIGKILL after the grace period
    print(limit.message())         # "time limit 30m reached: sent SIGTERM ..." or ""
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from devicekit.units import format_duration

__all__ = ["TimeLimit", "declared_limit", "enforced_limit"]


@dataclass
class TimeLimit:
    """One job's limit: :meth:`check` it while the job runs."""

    seconds: float
    grace: float
    started: float | None = None
    terminated_at: float | None = None
    killed: bool = False
    _signals: list[int] = field(default_factory=list)

    def start(self) -> None:
        self.started = time.monotonic()

    @property
    def reached(self) -> bool:
        return self.terminated_at is not None

    def check(self, pgid: int) -> None:
        """Signal the group ``pgid`` when due: SIGTERM at the limit, SIGKILL after the grace."""
        if self.started is None:
            self.start()
        now = time.monotonic()
        assert self.started is not None
        if self.terminated_at is None and now - self.started >= self.seconds:
            self.terminated_at = now
            _signal_group(pgid, signal.SIGTERM)
        elif (self.terminated_at is not None and not self.killed
              and now - self.terminated_at >= self.grace):
            self.killed = True
            _signal_group(pgid, signal.SIGKILL)

    def exit_code(self, code: int) -> int:
        """The code ``devicekit run`` exits with: the signal's (143/137) once the limit struck."""
        if not self.reached:
            return code
        return 128 + int(signal.SIGKILL if self.killed else signal.SIGTERM)

    def message(self) -> str:
        """One line for stderr once the limit struck ("" before)."""
        if not self.reached:
            return ""
        what = (f"sent SIGTERM, then SIGKILL after {format_duration(self.grace)}" if self.killed
                else "sent SIGTERM")
        return (f"time limit {format_duration(self.seconds)} (--time) reached: {what} to the job;"
                f" exit code {self.exit_code(0)}")


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def declared_limit(value: float | str | None) -> float | None:
    """``run --time``'s value in seconds (None: not given); a one-line error for a bad one."""
    if value is None:
        return None
    from devicekit.sharing.policy import parse_duration

    return parse_duration(value, name="--time")


def enforced_limit(declared: float | None, plan: Any, on_gpu: bool) -> TimeLimit | None:
    """The limit ``run`` enforces: the declared one, else the queue policy's default for GPU
    jobs; the grace period is the policy's. Adds a note to ``plan.notes``."""
    from devicekit.sharing.lease_directory import lease_dir
    from devicekit.sharing.policy import DEFAULT_GRACE, load_policy

    policy = load_policy(lease_dir()) if on_gpu or declared is not None else None
    if policy is not None and policy.note:  # the admin's quotas and limits are not in force
        plan.notes.append(f"queue policy {policy.note}: no quotas or default time limit apply")
    seconds = declared
    source = "--time"
    if seconds is None and policy is not None and on_gpu:
        seconds, source = policy.default_time_limit, "the queue policy's default_time_limit"
    if seconds is None:
        return None
    grace = policy.time_limit_grace if policy is not None else DEFAULT_GRACE
    plan.notes.append(f"time limit {format_duration(seconds)} ({source}): SIGTERM then, SIGKILL"
                      f" {format_duration(grace)} later")
    return TimeLimit(seconds, grace)
