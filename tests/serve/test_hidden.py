"""``--hide-commands`` on documents the live tests do not reach: MIG leases, stray leases,
commands with control characters, quoted commands cut short, and text it cannot account for."""

from __future__ import annotations

import copy
import json

from devicekit.hardware.printable import printable
from devicekit.serve.hidden import HIDDEN, hide_commands
from devicekit.serve.page import render_fragment
from devicekit.serve.prometheus import render_metrics

LONG = "python train.py --token=SECRET-LONG --epochs 100 --lr 3e-4"   # past describe's 40
ESCAPED = "python x.py --token=SECRET-ESC \x1b[2J\x1b]0;pwn\x07"


def lease(pid: int, command: str, uuid: str = "GPU-0", **extra) -> dict:
    return {"gpu_uuid": uuid, "pid": pid, "user": "alice", "host": "lab", "command": command,
            "since": 1.0, "memory": None, "share": False, "kind": "lease", **extra}


def document() -> dict:
    return {
        "host": {"hostname": "lab"}, "backend": "simulated", "taken_at": 100.0,
        "gpus": [{
            "index": 0, "uuid": "GPU-0", "name": "H100", "memory_total": 1, "memory_used": 0,
            "processes": [{"pid": 7, "user": "bob", "memory": 1, "command": "python SECRET-PROC"}],
            "leases": [lease(10, LONG), lease(11, ESCAPED, kind="lock")],
            "mig_devices": [{"index": 0, "uuid": "MIG-0", "leases": [lease(12, "SECRET-MIG",
                                                                          uuid="MIG-0")]}],
            "blocked": f"blocked: held by pid 11 ({ESCAPED})",
        }],
        "other_leases": [lease(13, "sleep SECRET-STRAY", uuid="GPU-gone")],
        "warnings": [f"the job of alice (pid 11, {printable(ESCAPED)[:60]}) is stopped since "
                     "10:00:00 and holds its GPU(s): resume it (fg, kill -CONT) or end it"],
        "queue": [
            {"ticket": "1", "user": "carol", "pid": 20, "command": "sleep SECRET-TICKET",
             "gpus_asked": 1, "since": 50.0,
             "reason": f"Busy: GPU 0 leased by alice (pid 10, {LONG[:37]}...) since 10:00"},
            {"ticket": "2", "user": "carol", "pid": 21, "command": "x",
             "gpus_asked": 1, "since": 51.0,
             "reason": "Busy: GPU 0 shared by alice (pid 12, SECRET-MIG, 8 GiB asked) since 10:00"},
            {"ticket": "3", "user": "carol", "pid": 22, "command": "y", "gpus_asked": 1,
             "since": 52.0, "reason": "Busy: GPU 0 leased by dave (pid 99, SECRET-UNKNOWN) since 9"},
        ],
    }


def test_every_command_field_is_null_and_the_original_untouched():
    doc = document()
    before = copy.deepcopy(doc)
    hidden = hide_commands(doc)
    assert doc == before
    gpu = hidden["gpus"][0]
    assert gpu["processes"][0]["command"] is None
    assert [x["command"] for x in gpu["leases"]] == [None, None]
    assert gpu["mig_devices"][0]["leases"][0]["command"] is None
    assert hidden["other_leases"][0]["command"] is None
    assert [t["command"] for t in hidden["queue"]] == [None, None, None]
    text = json.dumps(hidden)
    assert "SECRET" not in text and "python" not in text, text


def test_quoted_commands_are_cut_out_keeping_user_and_pid():
    hidden = hide_commands(document())
    first, second, third = (t["reason"] for t in hidden["queue"])
    assert first == "Busy: GPU 0 leased by alice (pid 10) since 10:00"
    assert second == "Busy: GPU 0 shared by alice (pid 12, 8 GiB asked) since 10:00"
    # a lease the document does not hold: fail closed, cut at the pid
    assert third == f"Busy: GPU 0 leased by dave (pid 99, {HIDDEN})"
    assert hidden["warnings"][0].startswith("the job of alice (pid 11) is stopped since 10:00:00")
    assert hidden["gpus"][0]["blocked"] == f"blocked: held by pid 11 ({HIDDEN})"


def test_renderers_show_nothing_of_it():
    hidden = hide_commands(document())
    for out in (render_fragment(hidden, hide_commands=True), render_metrics(hidden).decode()):
        assert "SECRET" not in out and "python" not in out
    assert "(pid 10) since 10:00" in render_fragment(hidden, hide_commands=True)


def test_queue_as_tickets_mapping_and_empty_commands():
    doc = {"gpus": [], "warnings": [], "queue": {"tickets": [
        {"ticket": "1", "user": "u", "pid": 1, "command": "", "reason": "Quota: u uses 2 of 2"},
        {"ticket": "2", "user": "u", "pid": 2, "command": "SECRET-T", "reason": "Filter: none"}]}}
    hidden = hide_commands(doc)
    tickets = hidden["queue"]["tickets"]
    assert [t["command"] for t in tickets] == [None, None]
    assert [t["reason"] for t in tickets] == ["Quota: u uses 2 of 2", "Filter: none"]
