"""The supervisor's side of the hang doctor: notice a hang, collect every rank's state, name the rank.

Each rank started by ``devicekit run`` or ``dk.launch`` records its collectives
(:mod:`devicekit.parallel.collective_log`) in a directory the supervisor made for it.
:class:`HangWatch` reads the ranks' small progress files: when no rank has made progress for
``hang_timeout`` seconds (or 3/4 of the process group's own timeout, whichever is shorter) while
some rank waits in a collective, the job hangs. :func:`collect` then asks every live rank for
its last collectives and its Python stack, and :func:`analyse` writes one report: which ranks
wait in which collective (seq N, at file:line), which rank never reached it and where it is now,
mismatched collectives or shapes, and, last, the rank to look at.

Usage::

    from devicekit.jobs.hang_report import HangWatch, collect, analyse

    watch = HangWatch(directory, world_size=2, hang_timeout=300)
    while job_runs():
        if watch.hung():
            report = analyse(collect(directory, 2), 2)
            print(report.text)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from devicekit.code_origin import library_of
from devicekit.jobs.private_files import create_private_file
from devicekit.jobs.rank_files import load_rank_file, read_rank_text
from devicekit.parallel.collective_log import FLIGHT_RECORDER_ENV, HANG_DIR_ENV, REQUEST_FILE

__all__ = ["ranks_of", "HangWatch", "HangReport", "collect", "analyse", "save", "HANG_DIR_ENV",
           "FLIGHT_RECORDER_ENV", "FLIGHT_RECORDER_ENTRIES",
           "DEFAULT_HANG_TIMEOUT", "HANG_EXIT_CODE", "diagnose",
           "finished_state"]

#: seconds without progress (while a rank waits in a collective) before a job counts as hung
DEFAULT_HANG_TIMEOUT = 600.0
#: ``devicekit run``'s exit code when it stopped a hung job (as timeout(1))
HANG_EXIT_CODE = 124
#: torch Flight Recorder entries kept per rank on NCCL groups (read only when a job hangs)
FLIGHT_RECORDER_ENTRIES = "256"
_read = read_rank_text
_load = load_rank_file


def ranks_of(world: int | Sequence[int]) -> list[int]:
    """The ranks to watch: ``range(world)`` for a count, else the list itself."""
    return list(range(world)) if isinstance(world, int) else sorted(world)


def _inert(text: object, limit: int = 200) -> str:
    """Text from a rank's file, safe to print: no control characters, bounded."""
    clean = "".join(ch if ch.isprintable() else "?" for ch in str(text))
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


class HangWatch:
    """No-progress clock over the ranks' progress files."""

    def __init__(self, directory: str, world_size: int | Sequence[int], hang_timeout: float) -> None:
        self.directory = directory
        self.ranks = ranks_of(world_size)
        self.hang_timeout = hang_timeout
        self.marks: dict[int, str] = {}
        self.changed = time.monotonic()

    def progress(self) -> dict[int, dict[str, Any]]:
        found = {}
        for rank in self.ranks:
            data = _load(os.path.join(self.directory, f"rank{rank}.progress"))
            if data is not None:
                found[rank] = data
        return found

    def limit(self, progress: dict[int, dict[str, Any]]) -> float:
        """``hang_timeout``, or 3/4 of the shortest process-group timeout a rank reported."""
        timeouts = [float(p["timeout"]) for p in progress.values()
                    if isinstance(p.get("timeout"), (int, float)) and p["timeout"] > 0]
        return min([self.hang_timeout] + [0.75 * t for t in timeouts])

    def hung(self) -> bool:
        """True once no rank has made progress for the limit while some rank waits."""
        progress = self.progress()
        now = time.monotonic()
        marks = {rank: json.dumps(p, sort_keys=True) for rank, p in progress.items()}
        if marks != self.marks:
            self.marks = marks
            self.changed = now
            return False
        if not progress or now - self.changed < self.limit(progress):
            return False
        # a rank whose Python code has finished (exiting) neither waits nor is behind
        live = [p for p in progress.values() if p.get("state") != "exiting"]
        if not live:
            return False
        waiting = any(p.get("state") == "started" for p in live)
        seqs = {p.get("torch_seq") for p in live}
        return waiting or len(seqs) > 1 or len(progress) < len(self.ranks)


def finished_state(directory: str, rank: int) -> dict[str, Any] | None:
    """What ``rank`` wrote when its Python code finished (state "exiting"), or None."""
    progress = _load(os.path.join(directory, f"rank{rank}.progress"))
    return progress if progress is not None and _finished_cleanly(progress) else None


def _finished_cleanly(progress: dict[str, Any]) -> bool:
    """The rank's Python code ended without an error (it wrote "exiting", clean, at exit)."""
    return progress.get("state") == "exiting" and progress.get("clean", True) is True


def collect(directory: str, world_size: int | Sequence[int], wait: float = 5.0) -> dict[int, dict[str, Any]]:
    """Ask every rank for its record and stack; what answered within ``wait`` seconds.

    A rank that does not answer (exited, or the probe never started) is represented by its
    last progress file, marked ``"answered": False``.
    """
    ranks = ranks_of(world_size)
    request = str(int(time.time() * 1000))
    tmp = os.path.join(directory, REQUEST_FILE + ".tmp")
    try:
        with open(tmp, "w") as handle:
            handle.write(request)
        os.replace(tmp, os.path.join(directory, REQUEST_FILE))
    except OSError:  # the job's directory is gone (the job ended): no rank can answer
        wait = 0.0
    deadline = time.monotonic() + wait
    answers: dict[int, dict[str, Any]] = {}
    while True:
        for rank in ranks:
            if rank in answers:
                continue
            data = _load(os.path.join(directory, f"rank{rank}.json"))
            if data is not None and str(data.get("request")) == request:
                data["answered"] = True
                data["progress"] = _load(os.path.join(directory, f"rank{rank}.progress")) or {}
                data["stack_text"] = _read(os.path.join(directory, f"rank{rank}.stack"))
                answers[rank] = data
        if len(answers) == len(ranks) or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for rank in ranks:
        if rank not in answers:
            progress = _load(os.path.join(directory, f"rank{rank}.progress")) or {}
            last = _load(os.path.join(directory, f"rank{rank}.last"))
            answers[rank] = {"rank": rank, "answered": False, "progress": progress,
                             "records": [last] if last else []}
    return answers


@dataclass
class HangReport:
    """What :func:`analyse` found: ``text`` to print, ``culprits`` to look at."""

    lines: list[str] = field(default_factory=list)
    culprits: list[int] = field(default_factory=list)
    #: True when at least one rank answered (a report from progress files alone says little)
    answered: bool = False
    #: one line per sequence number at which ranks call different collectives or shapes
    mismatches: list[str] = field(default_factory=list)
    #: every rank's answer, as :func:`collect` gave it
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _user_frame(stack: list[list[Any]]) -> str:
    """file:line in function of the innermost frame outside torch, devicekit and the stdlib.

    Their frames are known by where they are installed (:func:`library_of`), not by a folder
    name: a user's project in a folder named ``devicekit`` or ``torch`` is the user's code.
    """
    for filename, line, function in reversed(stack):
        if library_of(str(filename)) is not None:
            continue
        return _inert(f"{os.path.basename(str(filename))}:{line} in {function}")
    if stack:
        filename, line, function = stack[-1]
        return _inert(f"{os.path.basename(str(filename))}:{line} in {function}")
    return "?"


def _in_collective(answer: dict[str, Any]) -> dict[str, Any] | None:
    """The collective a rank waits in (its last record, still running), or None."""
    records = answer.get("records") or []
    last = records[-1] if records else None
    stack = answer.get("main_stack") or []
    in_torch = any("torch/distributed" in str(frame[0]).replace("\\", "/") for frame in stack[-8:])
    recorder = answer.get("flight_recorder") or {}
    flight = recorder.get("pending") or recorder.get("last") or {}
    if flight.get("profiling_name") and flight.get("retired") is False:
        # torch's own record (DDP's bucket all-reduces included), numbered by torch's sequence
        op = str(flight["profiling_name"]).split(":")[-1]
        where = last.get("where") if last is not None and last.get("state") == "started" else None
        return {"op": op, "seq": flight.get("collective_seq_id"), "shapes": flight.get("input_sizes") or [],
                "dtypes": [_DTYPES.get(str(d), str(d).lower()) for d in flight.get("input_dtypes") or []],
                "where": where or _user_frame(stack)}
    if last is not None and last.get("state") == "started":
        return last
    if in_torch:  # e.g. DDP's all-reduce inside backward(), not called from Python
        return {"op": "a collective inside torch (e.g. DDP's gradient all-reduce)",
                "seq": None, "where": _user_frame(stack), "shapes": [], "dtypes": []}
    return None


#: torch's scalar type names (the Flight Recorder's) as Python spells the dtypes
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
           "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
           "Bool": "bool"}


def _last_done(answer: dict[str, Any]) -> dict[str, Any] | None:
    """A rank's last collective, numbered as torch numbers it where the Flight Recorder is on."""
    records = answer.get("records") or []
    flight = (answer.get("flight_recorder") or {}).get("last") or {}
    if flight.get("profiling_name"):
        where = records[-1].get("where") if records else None
        return {"op": str(flight["profiling_name"]).split(":")[-1], "seq": flight.get("collective_seq_id"),
                "shapes": flight.get("input_sizes") or [], "where": where or "?",
                "dtypes": [_DTYPES.get(str(d), str(d).lower()) for d in flight.get("input_dtypes") or []]}
    return records[-1] if records else None


def _describe(entry: dict[str, Any]) -> str:
    seq = entry.get("seq")
    where = entry.get("where") or "?"
    if isinstance(where, str) and ":" in where and "/" in where:
        where = os.path.basename(where)
    text = f"{_inert(entry.get('op'))}" + (f" (seq {seq})" if seq is not None else "")
    if entry.get("shapes"):
        text += f" shapes {_inert(entry['shapes'])} {_inert(','.join(entry.get('dtypes') or []))}"
    return f"{text} at {_inert(where)}"


def analyse(answers: dict[int, dict[str, Any]], world_size: int | Sequence[int],
            who: str = "devicekit run") -> HangReport:
    """One report from every rank's answer: who waits where, who never came, who disagrees."""
    report = HangReport(answered=any(a.get("answered") for a in answers.values()))
    say = report.lines.append
    waiting: dict[int, dict[str, Any]] = {}
    elsewhere: dict[int, str] = {}
    silent: list[int] = []
    died_in: dict[int, dict[str, Any]] = {}  # silent ranks whose last collective never returned
    finished: list[int] = []  # ranks whose Python code has finished
    ranks = ranks_of(world_size)
    for rank in ranks:
        answer = answers.get(rank, {"answered": False})
        if _finished_cleanly(answer.get("progress") or {}):
            finished.append(rank)
            continue
        if not answer.get("answered"):
            silent.append(rank)
            records = answer.get("records") or []
            if records and records[-1].get("state") == "started":
                died_in[rank] = records[-1]
            continue
        entry = _in_collective(answer)
        if entry is not None:
            waiting[rank] = entry
        else:
            elsewhere[rank] = _user_frame(answer.get("main_stack") or [])
    say(f"{who}: hang report ({len(ranks)} ranks)")
    for rank in ranks:
        answer = answers.get(rank, {})
        if rank in waiting:
            say(f"  rank {rank}: waits in {_describe(waiting[rank])}")
        elif rank in elsewhere:
            previous = _last_done(answer)
            done = f"; last collective: {_describe(previous)}" if previous else "; no collective yet"
            say(f"  rank {rank}: not in a collective; now at {elsewhere[rank]}{done}")
        elif rank in finished:
            records = answer.get("records") or []
            last = f"; its last collective: {_describe(records[-1])}" if records else ""
            say(f"  rank {rank}: its Python code has finished (exiting or exited){last}")
        elif rank in died_in:
            say(f"  rank {rank}: did not answer (exited or died) inside {_describe(died_in[rank])}")
        else:
            records = answer.get("records") or []
            last = f"; its last collective: {_describe(records[-1])}" if records else ""
            say(f"  rank {rank}: did not answer: exited, or it does not record"
                f" (its script does not call dk.dist.init){last}")
    # mismatches among the waiting ranks: same seq, different op or shapes
    by_seq: dict[Any, dict[int, dict[str, Any]]] = {}
    for rank, entry in {**waiting, **died_in}.items():
        by_seq.setdefault(entry.get("seq"), {})[rank] = entry
    mismatched: list[int] = []
    for seq, group in by_seq.items():
        ops = {(e.get("op"), json.dumps(e.get("shapes"))) for e in group.values()}
        if seq is None or len(ops) < 2:
            continue
        parts = " vs ".join(f"rank {r} {_inert(e.get('op'))} {_inert(e.get('shapes'))}"
                            for r, e in sorted(group.items()))
        say(f"  mismatch at seq {seq}: {parts}")
        report.mismatches.append(f"mismatch at seq {seq}: {parts}")
        mismatched.extend(_minority(group))
    seqs = sorted({e.get("seq") for e in waiting.values() if e.get("seq") is not None})
    if len(seqs) > 1:
        behind = sorted(r for r, e in waiting.items() if e.get("seq") == seqs[0])
        say(f"  ranks wait at different sequence numbers ({seqs}): rank(s) {behind} behind"
            " (a skipped or extra collective)")
    if elsewhere and waiting:
        report.culprits = sorted(elsewhere)
        first = next(iter(waiting.values()))
        why = (f"it never reached {_inert(first.get('op'))}"
               + (f" seq {first.get('seq')}" if first.get("seq") is not None else "")
               + f" that rank(s) {sorted(waiting)} wait in; it is at "
               + ", ".join(elsewhere[r] for r in report.culprits))
    elif mismatched:
        report.culprits = sorted(set(mismatched))
        why = ("their collectives differ at the same sequence number" if len(report.culprits) > 1
               else "its collective differs from its peers' at the same sequence number")
    elif silent and waiting:
        report.culprits = silent
        why = f"it did not answer while rank(s) {sorted(waiting)} wait in a collective"
    elif finished and waiting:
        report.culprits = finished
        why = (f"its Python code finished while rank(s) {sorted(waiting)} still wait in a"
               " collective (it made fewer collectives)")
    elif len(seqs) > 1:
        report.culprits = sorted(r for r, e in waiting.items() if e.get("seq") == seqs[0])
        why = "it is behind its peers by at least one collective"
    else:
        report.culprits = sorted(elsewhere) or silent or sorted(waiting)
        why = "no rank waits in a collective: the whole job stopped making progress"
    names = " and ".join(str(r) for r in report.culprits)
    say(f"{who}: look at rank{'s' if len(report.culprits) > 1 else ''} {names}: {why}")
    return report


def diagnose(directory: str, world_size: int | Sequence[int], who: str = "devicekit run",
             wait: float = 5.0) -> HangReport:
    """:func:`collect` then :func:`analyse`; the answers are kept on ``report.answers``."""
    answers = collect(directory, world_size, wait)
    report = analyse(answers, world_size, who)
    report.answers = answers
    return report


def _minority(group: dict[int, dict[str, Any]]) -> list[int]:
    """The ranks whose (op, shapes) fewer ranks share; every rank on a tie."""
    counts: dict[str, list[int]] = {}
    for rank, entry in group.items():
        counts.setdefault(json.dumps([entry.get("op"), entry.get("shapes")]), []).append(rank)
    smallest = min(len(ranks) for ranks in counts.values())
    if all(len(ranks) == smallest for ranks in counts.values()):
        return sorted(group)
    return sorted(r for ranks in counts.values() if len(ranks) == smallest for r in ranks)


def save(report: HangReport, answers: dict[int, dict[str, Any]], directory: str) -> str:
    """Write the report and every rank's full answer (stacks of all threads) to
    ``directory/hang-report.txt``; its path.

    The file holds every thread's stack: it is created new, mode 0600, never through a symlink
    (:func:`~devicekit.jobs.private_files.create_private_file`); an existing ``hang-report.txt``
    raises ``FileExistsError``. In a directory other users can write, pass a fresh
    :func:`~devicekit.jobs.private_files.private_directory` (as ``devicekit run`` does).
    """
    path = os.path.join(directory, "hang-report.txt")
    with create_private_file(directory, "hang-report.txt") as handle:
        handle.write(report.text + "\n")
        for rank in sorted(answers):
            answer = answers[rank]
            handle.write(f"\n===== rank {rank} =====\n")
            for entry in answer.get("records") or []:
                handle.write(f"  {_describe(entry)} [{_inert(entry.get('state'))}]\n")
            if answer.get("flight_recorder"):
                handle.write(f"  torch flight recorder: {_inert(answer['flight_recorder'], 2000)}\n")
            handle.write(_inert_block(answer.get("stack_text") or "(no stack)") + "\n")
    return path


def _inert_block(text: str) -> str:
    return "\n".join(_inert(line, 400) for line in text.splitlines())
