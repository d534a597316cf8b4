"""The hang report from the ranks' answers (no processes): who waits, who never came, who disagrees."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from devicekit.jobs.hang_report import HangWatch, analyse, collect, save


def waiting(seq: int, op: str = "all_reduce", shapes: Any = None, where: str = "/w/train.py:9") -> dict:
    records = [{"seq": s, "op": "all_reduce", "shapes": [[4]], "dtypes": ["float32"],
                "where": where, "state": "completed"} for s in range(1, seq)]
    records.append({"seq": seq, "op": op, "shapes": shapes or [[4]], "dtypes": ["float32"],
                    "where": where, "state": "started"})
    stack = [["/w/train.py", 9, "<module>"], ["/x/torch/distributed/distributed_c10d.py", 3252, op]]
    return {"answered": True, "records": records, "main_stack": stack}


def busy(done: int, line: int = 7) -> dict:
    records = [{"seq": s, "op": "all_reduce", "shapes": [[4]], "dtypes": ["float32"],
                "where": "/w/train.py:9", "state": "completed"} for s in range(1, done + 1)]
    return {"answered": True, "records": records,
            "main_stack": [["/w/train.py", line, "<module>"], ["/w/loader.py", 40, "next_batch"]]}


def test_rank_that_never_reached_the_collective_is_named_with_its_line() -> None:
    report = analyse({0: waiting(4), 1: busy(3)}, 2)
    assert report.culprits == [1]
    assert "rank 0: waits in all_reduce (seq 4) shapes [[4]] float32 at train.py:9" in report.text
    assert "rank 1: not in a collective; now at loader.py:40 in next_batch" in report.text
    assert report.lines[-1].startswith("devicekit run: look at rank 1: it never reached all_reduce"
                                       " seq 4 that rank(s) [0] wait in; it is at loader.py:40")


def test_mismatched_collectives_name_both_ranks_and_both_ops() -> None:
    report = analyse({0: waiting(2), 1: waiting(2, op="broadcast")}, 2)
    assert "mismatch at seq 2: rank 0 all_reduce [[4]] vs rank 1 broadcast [[4]]" in report.text
    assert report.culprits == [0, 1]
    assert "look at ranks 0 and 1: their collectives differ" in report.lines[-1]


def test_mismatched_shapes_name_the_odd_rank_out() -> None:
    report = analyse({0: waiting(1), 1: waiting(1), 2: waiting(1, shapes=[[5]])}, 3)
    assert "mismatch at seq 1:" in report.text and "rank 2 all_reduce [[5]]" in report.text
    assert report.culprits == [2]


def test_rank_behind_by_a_collective_is_named() -> None:
    report = analyse({0: waiting(5), 1: waiting(5), 2: waiting(4)}, 3)
    assert report.culprits == [2]
    assert "behind" in report.lines[-1]


def test_silent_rank_that_died_inside_a_collective_still_counts() -> None:
    dead = {"answered": False, "records": [{"seq": 1, "op": "all_reduce", "shapes": [[4]],
                                            "dtypes": ["float32"], "where": "t.py:3",
                                            "state": "started"}]}
    report = analyse({0: dead, 1: waiting(1, shapes=[[5]])}, 2)
    assert "rank 0: did not answer (exited or died) inside all_reduce (seq 1)" in report.text
    assert report.mismatches == ["mismatch at seq 1: rank 0 all_reduce [[4]] vs rank 1 all_reduce [[5]]"]


def test_text_from_a_rank_is_printed_inert(tmp_path: Path) -> None:
    evil = waiting(1, where="/w/\x1b[2Jtrain.py:9")
    report = analyse({0: evil, 1: busy(0)}, 2)
    assert "\x1b" not in report.text
    path = save(report, {0: dict(evil, stack_text="Thread 1\n\x1b]0;x\x07 File")}, str(tmp_path))
    assert "\x1b" not in Path(path).read_text()


def _progress(directory: Path, rank: int, **values: Any) -> None:
    (directory / f"rank{rank}.progress").write_text(json.dumps(values))


def test_watch_fires_only_without_progress_while_a_rank_waits(tmp_path: Path) -> None:
    watch = HangWatch(str(tmp_path), 2, hang_timeout=0.2)
    _progress(tmp_path, 0, torch_seq=3, seq=3, state="completed", timeout=60)
    _progress(tmp_path, 1, torch_seq=3, seq=3, state="completed", timeout=60)
    assert not watch.hung()
    time.sleep(0.3)
    assert not watch.hung()  # both compute between collectives: slow, not hung
    _progress(tmp_path, 0, torch_seq=4, seq=4, state="started", timeout=60)
    assert not watch.hung()  # progress: the clock restarts
    time.sleep(0.3)
    assert watch.hung()


def test_watch_limit_is_below_the_process_group_timeout(tmp_path: Path) -> None:
    watch = HangWatch(str(tmp_path), 1, hang_timeout=600)
    _progress(tmp_path, 0, torch_seq=1, seq=1, state="started", timeout=20)
    assert watch.limit(watch.progress()) == 15


def test_collect_falls_back_to_what_a_silent_rank_left(tmp_path: Path) -> None:
    (tmp_path / "rank1.last").write_text(json.dumps({"seq": 2, "op": "broadcast", "state": "started"})
                                         + " " * 100)
    answers = collect(str(tmp_path), 2, wait=0.2)
    assert answers[0] == {"rank": 0, "answered": False, "progress": {}, "records": []}
    assert answers[1]["records"][0]["op"] == "broadcast"


def test_a_rank_killed_after_its_python_code_finished_is_said_plainly(
        tmp_path: Path, monkeypatch: Any) -> None:
    from devicekit.jobs.torchrun_entry import finished_note

    monkeypatch.setenv("DEVICEKIT_HANG_DIR", str(tmp_path))
    _progress(tmp_path, 1, torch_seq=4, seq=4, state="exiting", op="all_reduce", timeout=60)
    _progress(tmp_path, 0, torch_seq=4, seq=4, state="started", timeout=60)
    note = finished_note(1, -6)
    assert note.startswith("rank 1 had finished its Python code, after its last collective"
                           " (seq 4, all_reduce): it was killed in torch's teardown")
    assert finished_note(0, -6) == ""  # still inside a collective: not "after its work"
    assert finished_note(1, 1) == ""  # an exit code, not a signal


def test_watch_ignores_ranks_whose_python_code_finished(tmp_path: Path) -> None:
    watch = HangWatch(str(tmp_path), 2, hang_timeout=0.2)
    _progress(tmp_path, 0, torch_seq=6, seq=6, state="exiting", timeout=60)
    _progress(tmp_path, 1, torch_seq=6, seq=6, state="exiting", timeout=60)
    watch.hung()
    time.sleep(0.3)
    assert not watch.hung()  # a slow exit is not a hang
    _progress(tmp_path, 0, torch_seq=7, seq=7, state="started", timeout=60)
    watch.hung()
    time.sleep(0.3)
    assert watch.hung()  # rank 0 waits for rank 1, which has finished: a hang
    finished = {"answered": False, "progress": {"state": "exiting"},
                "records": [{"seq": 6, "op": "all_reduce", "state": "completed", "where": "t.py:5"}]}
    report = analyse({0: waiting(7), 1: finished}, 2)
    assert report.culprits == [1]
    assert "rank 1: its Python code has finished" in report.text
