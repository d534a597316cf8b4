"""The monitoring files in docs/lab/ (Grafana dashboard, Prometheus scrape config, alert rules)
use only metrics ``/metrics`` emits; and the metrics they need: idle leased GPUs, queue waits,
free GPUs, lease directory trouble, and the lease's job label."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from devicekit.serve.idle import IdleTracker
from devicekit.serve.prometheus import render_metrics

LAB = Path(__file__).resolve().parents[2] / "docs" / "lab"
METRIC = re.compile(r"\bdevicekit_[a-z_]+\b")
#: when the leases and tickets below began (their documents are taken later)
T0 = time.time()


def values(text: bytes, metric: str) -> dict[tuple, float]:
    found = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name == metric:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def a_lab_document(taken_at: float) -> dict[str, Any]:
    """GPU 0 leased (job "bert") and idle; GPU 1 leased and busy; GPU 2 free; GPU 3 blocked;
    GPU 4 in MIG mode, one of two instances leased; two tickets wait, one for GPU 2."""
    now = T0

    def lease(uuid: str, user: str, job: str | None, since: float) -> dict[str, Any]:
        return {"gpu_uuid": uuid, "pid": 7, "user": user, "host": "h", "command": "x",
                "since": since, "memory": None, "share": False, "kind": "lease", "job": job}

    gpu = {"name": "H100", "memory_total": 100, "memory_used": 0, "memory_free": 100,
           "processes": [], "leases": [], "mig_devices": [], "mig_enabled": False}
    return {
        "schema": 1, "taken_at": taken_at, "host": {"hostname": "h"}, "warnings": [
            "leases not shown: lease directory '/tmp/x' is owned by mallory", "GPU 3 is blocked"],
        "gpus": [
            {**gpu, "index": 0, "uuid": "GPU-0", "utilization": 0,
             "leases": [lease("GPU-0", "alice", "bert", now - 4000)]},
            {**gpu, "index": 1, "uuid": "GPU-1", "utilization": 80,
             "leases": [lease("GPU-1", "bob", None, now - 100)]},
            {**gpu, "index": 2, "uuid": "GPU-2", "utilization": 0},
            {**gpu, "index": 3, "uuid": "GPU-3", "utilization": 0, "blocked": "squatted by eve"},
            {**gpu, "index": 4, "uuid": "GPU-4", "utilization": None, "mig_enabled": True,
             "mig_devices": [{"index": 0, "uuid": "MIG-a", "leases": [
                 lease("MIG-a", "carol", "c1", now - 50)]}, {"index": 1, "uuid": "MIG-b",
                                                             "leases": []}],
             "leases": [lease("MIG-a", "carol", "c1", now - 50)]},
        ],
        "other_leases": [],
        "queue": [{"ticket": "1", "user": "dave", "gpus_asked": 2, "since": now - 7200,
                   "reserved_uuids": ["GPU-2"], "reason": "Reserved"},
                  {"ticket": "2", "user": "erin", "gpus_asked": 1, "since": now - 60,
                   "reserved_uuids": [], "reason": "Busy"}],
    }


def emitted_metrics() -> set[str]:
    now = time.time()
    doc = IdleTracker().annotate(a_lab_document(now))
    text = render_metrics(doc).decode()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    return names | {f"{n}_total" for n in names if n.endswith("_errors")}


def test_new_metrics_say_what_the_alerts_need():
    now = T0
    tracker = IdleTracker()
    first = tracker.annotate(a_lab_document(now - 1900))  # the first sample: idle from now on
    assert first["gpus"][0]["leases"][0]["idle_since"] == now - 1900
    assert first["gpus"][1]["leases"][0]["idle_since"] is None  # busy
    doc = tracker.annotate(a_lab_document(now))
    text = render_metrics(doc)
    idle = values(text, "devicekit_lease_idle_seconds")
    alice = (("gpu", "0"), ("job_id", "bert"), ("kind", "lease"), ("user", "alice"),
             ("uuid", "GPU-0"))
    bob = (("gpu", "1"), ("job_id", ""), ("kind", "lease"), ("user", "bob"), ("uuid", "GPU-1"))
    assert idle == {alice: pytest.approx(1900), bob: 0}  # MIG: utilization unknown, left out
    assert values(text, "devicekit_lease_holders")[alice] == 1
    assert values(text, "devicekit_queue_wait_seconds") == {(): pytest.approx(7200)}
    assert values(text, "devicekit_user_queue_wait_seconds") == {
        (("user", "dave"),): pytest.approx(7200), (("user", "erin"),): pytest.approx(60)}
    assert values(text, "devicekit_gpus_free") == {(): 1}  # MIG-b; GPU 2 is reserved
    assert values(text, "devicekit_lease_directory_problems") == {(): 2}  # unreadable + GPU 3
    busy_again = a_lab_document(now + 10)
    busy_again["gpus"][0]["utilization"] = 50
    assert tracker.annotate(busy_again)["gpus"][0]["leases"][0]["idle_since"] is None
    quiet = tracker.annotate(a_lab_document(now + 20))
    assert quiet["gpus"][0]["leases"][0]["idle_since"] == now + 20  # counts again from here


def test_dashboard_is_importable_json_using_only_emitted_metrics():
    dashboard = json.loads((LAB / "grafana-dashboard.json").read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10 and all(p["gridPos"] for p in dashboard["panels"])
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    used = {m for e in exprs for m in METRIC.findall(e)}
    used |= set(METRIC.findall(json.dumps(dashboard["templating"])))
    assert {"devicekit_gpus_free", "devicekit_user_leased_devices", "devicekit_lease_idle_seconds",
            "devicekit_queue_wait_seconds"} <= used
    assert used - emitted_metrics() == set(), "the dashboard uses metrics /metrics lacks"


@pytest.mark.parametrize("name", ["alerts.yml", "prometheus.yml"])
def test_prometheus_files_use_only_emitted_metrics(name):
    used = set(METRIC.findall((LAB / name).read_text()))
    assert used - emitted_metrics() == set(), f"{name} uses metrics /metrics lacks"


def test_alert_rules_and_scrape_config_parse():
    yaml = pytest.importorskip("yaml")
    rules = yaml.safe_load((LAB / "alerts.yml").read_text())
    alerts = {r["alert"]: r for group in rules["groups"] for r in group["rules"]}
    assert alerts["DevicekitLeasedGpuIdle"]["expr"] == "devicekit_lease_idle_seconds > 1800"
    assert alerts["DevicekitQueueWaitOverAnHour"]["expr"] == "devicekit_queue_wait_seconds > 3600"
    assert alerts["DevicekitLeaseDirectoryProblem"]["expr"] == \
        "devicekit_lease_directory_problems > 0"
    for rule in alerts.values():
        assert rule["annotations"]["summary"] and rule["labels"]["severity"]
        assert set(METRIC.findall(rule["expr"])) <= emitted_metrics()
    config = yaml.safe_load((LAB / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "devicekit" and job["metrics_path"] == "/metrics"
    assert all(t.endswith(":9400") for t in job["static_configs"][0]["targets"])
    assert re.fullmatch(job["relabel_configs"][0]["regex"], "gpu1.lab.example:9400").group(1) \
        == "gpu1.lab.example"
