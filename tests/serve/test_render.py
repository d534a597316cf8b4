"""The page and metrics renderers on documents the live tests do not reach: the fair queue's
optional ``queue`` section, MIG instances and their leases, many users, and inert text."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

import devicekit as dk
from devicekit.serve.inert import inert_html, inert_text
from devicekit.serve.page import render_fragment, render_page
from devicekit.serve.people import OTHER, user_totals
from devicekit.serve.prometheus import render_metrics
from devicekit.sharing.lease_directory import lease_dir
from devicekit.sharing.leases import Lease
from devicekit.sharing.machine_status import collect_status
from devicekit.sharing.queue_order import Decision
from devicekit.sharing.queue_state import QueueEntry, QueueEntryDoc
from devicekit.sharing.tickets import Ticket, TicketRecord
from tests.conftest import h100
from tests.serve.conftest import machine


def values(text: bytes, metric: str) -> dict[tuple, float]:
    found = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name == metric:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def waiting(ticket: str, user: str, count: int, since: float, reason: str,
            reserved: tuple[str, ...] = ()) -> QueueEntryDoc:
    """A waiting entry as ``status --json`` has it: made by the queue's own ``to_dict``."""
    record = TicketRecord(ticket=ticket, seq=int(ticket), user=user, pid=4000 + int(ticket),
                          host="lab", command="python train.py", count=count, candidates=(),
                          min_free=None, max_util=None, filters="", since=since,
                          time_limit=None, grace=30.0, state="waiting")
    return QueueEntry(record, Decision(ticket, reserved=reserved, reason=reason)).to_dict()


def doc_with_queue(simulate) -> dict:
    simulate(machine())
    doc = json.loads(json.dumps(collect_status().to_dict()))
    since = doc["taken_at"] - 3720
    doc["queue"] = [
        waiting("1", "bob", 2, since, "2 GPUs asked, 1 free"),
        waiting("2", "bob", 1, since + 60, "waiting behind bob"),
        waiting("3", "<i>carol</i>", 2, since + 120, "reserved \x1b[5mfor\x1b[0m carol",
                reserved=("GPU-x", "GPU-y")),
    ]
    return json.loads(json.dumps(doc))


def test_queue_section_in_metrics_and_page(simulate):
    doc = doc_with_queue(simulate)
    text = render_metrics(doc)
    assert values(text, "devicekit_queue_waiting_jobs") == {(): 3}
    assert values(text, "devicekit_queue_oldest_since_timestamp_seconds") == {
        (): doc["taken_at"] - 3720}
    assert values(text, "devicekit_user_waiting_jobs")[(("user", "bob"),)] == 2
    assert values(text, "devicekit_user_waiting_gpus")[(("user", "bob"),)] == 3
    assert values(text, "devicekit_user_waiting_gpus")[(("user", "<i>carol</i>"),)] == 2
    page = render_fragment(doc)
    assert "<h2>Queue</h2>" in page and "2 GPUs asked, 1 free" in page
    assert "1h02m" in page  # bob has waited 62 minutes
    assert "&lt;i&gt;carol&lt;/i&gt;" in page and "<i>carol" not in page
    assert "\\x1b[5mfor" in page and "\x1b" not in page and "reserved" in page


def test_a_real_three_gpu_ticket_counts_three_waiting_gpus(simulate):
    """The queue's own entries (``gpus_asked``), not a hand-made shape: a 3-GPU ticket is 3."""
    simulate(machine())
    uuids = [g.uuid for g in dk.gpus()]
    ticket = Ticket.take(lease_dir(), {"count": 3, "candidates": uuids, "command": "python big.py"})
    try:
        doc = collect_status().to_dict()
    finally:
        ticket.close()
    (entry,) = doc["queue"]
    user = entry["user"]  # the ticket file's owner: whoever runs the tests
    assert entry["gpus_asked"] == 3
    text = render_metrics(doc)
    assert values(text, "devicekit_user_waiting_gpus")[(("user", user),)] == 3
    assert values(text, "devicekit_user_waiting_jobs")[(("user", user),)] == 1
    assert f"<td>{user}</td><td>3</td>" in render_fragment(doc)


def test_no_queue_section_without_a_queue(simulate):
    simulate(machine())
    doc = collect_status().to_dict()
    assert "Queue" not in render_fragment(doc)
    assert values(render_metrics(doc), "devicekit_queue_waiting_jobs") == {(): 0}
    doc["queue"] = []
    assert "Nobody waits." in render_fragment(doc)


def test_mig_instances_and_their_leases(simulate):
    mig = [{"name": "1g.10gb", "memory_total": "10GiB", "memory_used": "1GiB"},
           {"name": "3g.40gb", "memory_total": "40GiB", "memory_used": "0GiB"}]
    simulate([h100(), {"name": "NVIDIA A100-SXM4-80GB", "memory_total": "80GiB",
                       "memory_used": "1GiB", "utilization": 0, "mig": mig}])
    parent = dk.gpus()[1]
    instance = parent.mig_devices[1]
    with Lease.acquire([instance.uuid], command="python mig.py"):
        doc = collect_status().to_dict()
    text = render_metrics(doc)
    host = doc["host"]["hostname"]
    used = values(text, "devicekit_mig_memory_used_bytes")
    key = tuple(sorted({"gpu": "1", "mig": "0", "uuid": parent.mig_devices[0].uuid,
                        "name": "1g.10gb", "hostname": host}.items()))
    assert used[key] == 2**30 and len(used) == 2
    total = values(text, "devicekit_mig_memory_total_bytes")
    assert sorted(total.values()) == [10 * 2**30, 40 * 2**30]
    (lease_key,) = values(text, "devicekit_lease_holders")
    assert dict(lease_key)["gpu"] == "1" and dict(lease_key)["uuid"] == instance.uuid
    page = render_fragment(doc)
    assert f'data-uuid="{instance.uuid}"' in page and "3g.40gb" in page
    row = page.split(f'data-uuid="{instance.uuid}"')[1].split("</tr>")[0]
    assert dict(lease_key)["user"] in row  # the holder is shown on its instance
    simulate([{"name": "NVIDIA A100-SXM4-80GB", "memory_total": "80GiB", "memory_used": "0GiB",
               "utilization": 0, "mig": True}])
    assert "MIG mode, no instances" in render_fragment(collect_status().to_dict())


def test_users_are_bounded():
    procs = [{"pid": k, "user": f"user{k:03d}", "memory": (k + 1) * 2**20, "command": "x"}
             for k in range(120)]
    doc = {"gpus": [{"index": 0, "uuid": "GPU-1", "name": "x", "processes": procs, "leases": []}]}
    rows = user_totals(doc, limit=50)
    assert len(rows) == 50 and rows[-1].user == OTHER
    assert rows[0].user == "user119"  # the busiest first
    assert sum(r.processes for r in rows) == 120
    assert sum(r.gpu_memory for r in rows) == sum(p["memory"] for p in procs)
    metric = values(render_metrics(doc), "devicekit_user_processes")
    assert len(metric) == 50


def test_inert_text():
    assert inert_text("a\x1b[31mb\x07\x9b\u202e") == "a\\x1b[31mb\\x07\\x9b\\u202e"
    assert inert_html('"><script>') == "&quot;&gt;&lt;script&gt;"
    assert inert_text("x" * 1000).endswith("\u2026") and len(inert_text("x" * 1000)) == 301
    assert inert_text(None) == ""


def test_page_without_gpus_and_with_unknowns():
    doc = {"host": {"hostname": "<lab>"}, "gpus": [], "warnings": ["no NVIDIA driver"],
           "devicekit_version": "0", "backend": "none", "taken_at": 0}
    page = render_page(doc, interval=2)
    assert "GPUs on &lt;lab&gt;" in page and "No GPUs on this machine." in page
    assert "no NVIDIA driver" in page and 'data-interval-ms="2000"' in page
    gpu = {"index": 0, "uuid": "GPU-1", "name": "x", "memory_total": 0, "memory_used": 0,
           "utilization": None, "processes": [{"pid": 1, "user": None, "memory": None,
                                               "command": None}], "leases": []}
    page = render_fragment({**doc, "gpus": [gpu]})
    assert "n/a" in page and "(unknown)" in page


def test_label_values_round_trip_through_the_parser():
    """User names with quotes, backslashes and newlines stay one label value; a control
    character is written escaped (a terminal showing the page never obeys it)."""
    odd = 'a"b\\c\nd} x{y="1"'
    doc = {"gpus": [{"index": 0, "uuid": "GPU-1", "name": 'GPU "x"', "memory_used": 5,
                     "processes": [{"pid": 1, "user": odd, "memory": 7, "command": "x"}],
                     "leases": []}], "host": {"hostname": "h"}}
    text = render_metrics(doc)
    shown = odd.replace("\n", "\\x0a")
    assert values(text, "devicekit_user_gpu_memory_bytes") == {(("user", shown),): 7}
    (labels,) = values(text, "devicekit_gpu_memory_used_bytes")
    assert dict(labels)["name"] == 'GPU "x"'


def _documented_metrics() -> set[str]:
    """Every metric name in docs/serve.md's table (first column, backticked)."""
    page = Path(__file__).resolve().parents[2] / "docs" / "serve.md"
    names: set[str] = set()
    for line in page.read_text().splitlines():
        if line.startswith("| `devicekit_"):
            names.update(re.findall(r"`(devicekit_[a-z_]+)`", line.split("|")[1]))
    return names


def test_docs_metric_table_is_what_metrics_emits(simulate):
    """docs/serve.md lists exactly the families /metrics emits (a queue and MIG present)."""
    doc = doc_with_queue(simulate)
    emitted = {line.split()[2] for line in render_metrics(doc).decode().splitlines()
               if line.startswith("# TYPE ")}
    emitted |= {f"{name}_total" for name in emitted if name.endswith("_errors")}  # counters
    documented = _documented_metrics()
    assert documented, "the metric table in docs/serve.md was not found"
    assert documented - emitted == set(), "documented but not emitted"
    assert {n for n in emitted if not n.endswith("_errors")} - documented == set(), \
        "emitted but not in docs/serve.md's table"
