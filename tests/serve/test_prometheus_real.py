"""The lab's monitoring files (docs/lab/) against the real thing: Debian's Prometheus scraping a
real ``devicekit serve``, every dashboard query asked through Prometheus's query API with the
dashboard's variables filled in, and the alert rules unit-tested with ``promtool test rules``.

Needs ``prometheus`` and ``promtool`` (``apt-get install prometheus``; ``.ci/run`` installs it
where it can); the tests skip with the reason where they are missing. Everything listens on
loopback, lives in a temporary directory and is stopped at the end (bounded waits).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devicekit.sharing.leases import Lease
from devicekit.sharing.tickets import Ticket
from tests.conftest import h100
from tests.serve.conftest import ServeProcesses, stop_process

LAB = Path(__file__).resolve().parents[2] / "docs" / "lab"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="Prometheus is not installed (apt-get install prometheus; .ci/run does it as root)")
UUIDS = ["GPU-11111111-0000-0000-0000-000000000000", "GPU-22222222-0000-0000-0000-000000000000",
         "GPU-33333333-0000-0000-0000-000000000000"]
JOB_ID = "bert-7"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def api(base: str, path: str, **params: str) -> Any:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else base + path
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]


def query(base: str, expr: str) -> list[dict[str, Any]]:
    data = api(base, "/api/v1/query", query=expr)
    assert data["resultType"] == "vector", data
    return list(data["result"])


class Lab:
    """Prometheus at ``base`` scraping one ``devicekit serve`` at ``target``."""

    def __init__(self, base: str, target: str) -> None:
        self.base, self.target = base, target


def _config(directory: Path, target: str) -> Path:
    """docs/lab/prometheus.yml pointed at ``target``, scraping every second."""
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((LAB / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(LAB / "alerts.yml")]
    (job,) = config["scrape_configs"]
    job.update(scrape_interval="1s", scrape_timeout="1s")
    job.pop("file_sd_configs")
    job["static_configs"][0]["targets"] = [target]
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def _wait(what: str, check: Any, seconds: float = 30.0) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        try:
            got = check()
        except OSError:
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"{what} within {seconds:g} s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    if PROMETHEUS is None:
        pytest.skip("Prometheus is not installed (apt-get install prometheus)")
    work = Path(tempfile.mkdtemp(prefix="devicekit-prometheus-"))
    leases = work / "leases"
    leases.mkdir(mode=0o700)
    simulation = work / "gpus.json"
    simulation.write_text(json.dumps({"gpus": [
        h100(uuid=UUIDS[0], util=0), h100(uuid=UUIDS[1], util=80, used="40GiB"),
        h100(uuid=UUIDS[2])]}))
    saved = {k: os.environ.get(k) for k in ("DEVICEKIT_SIMULATE", "DEVICEKIT_LEASE_DIR")}
    os.environ.update(DEVICEKIT_SIMULATE=str(simulation), DEVICEKIT_LEASE_DIR=str(leases))
    serving = ServeProcesses()
    prometheus: subprocess.Popen[bytes] | None = None
    held: list[Any] = []
    try:
        # GPU 0 leased by a named job and idle, GPU 1 leased and busy, GPU 2 free; one job
        # waits for GPU 0
        held.append(Lease.acquire([UUIDS[0]], job=JOB_ID, command="python train.py"))
        held.append(Lease.acquire([UUIDS[1]], job="812_3"))
        held.append(Ticket.take(leases, {"count": 1, "candidates": [UUIDS[0]],
                                         "command": "python next.py"}))
        _, url = serving(simulation, leases, "--interval", "200ms")
        target = urllib.parse.urlsplit(url).netloc
        port = free_port()
        prometheus = subprocess.Popen(
            [PROMETHEUS, f"--config.file={_config(work, target)}",
             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        base = f"http://127.0.0.1:{port}"
        _wait("Prometheus ready", lambda: prometheus.poll() is None and urllib.request.urlopen(
            base + "/-/ready", timeout=2).status == 200)
        _wait("a scrape of devicekit serve",
              lambda: query(base, 'devicekit_lease_holders{job_id="bert-7"}'))
        yield Lab(base, target)
    finally:
        if prometheus is not None:
            stop_process(prometheus)
        serving.stop_all()
        for thing in held:
            thing.close() if isinstance(thing, Ticket) else thing.release()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(work, ignore_errors=True)


def dashboard_targets() -> list[tuple[str, str]]:
    doc = json.loads((LAB / "grafana-dashboard.json").read_text())
    return [(panel["title"], target["expr"]) for panel in doc["panels"]
            for target in panel.get("targets", [])]


def fill(expr: str, instance: str | None) -> str:
    """The dashboard's variables as Grafana fills them: ``$instance`` is the "All" value
    (``.*``) or one host, regex-escaped inside the PromQL string (Grafana's own escaping)."""
    value = ".*" if instance is None else re.escape(instance).replace("\\", "\\\\")
    return expr.replace("${instance}", value).replace("$instance", value)


#: what each panel must show here: (labels every series carries, a check of the values)
EXPECTED: dict[str, tuple[set[str], Any]] = {
    "Free GPUs per host": ({"instance"}, lambda v: v == [1.0]),  # GPU 2
    "GPUs per host": ({"instance"}, lambda v: v == [3.0]),
    "Lease directory problems": ({"instance"}, lambda v: v == [0.0]),
    "Leased devices per user": ({"user"}, lambda v: v == [2.0]),
    "Free GPUs over time": ({"instance"}, lambda v: v == [1.0]),
    "Who holds what": ({"instance", "user", "job_id"}, lambda v: v == [1.0, 1.0]),
    "Queue: waiting jobs": ({"instance"}, lambda v: v == [1.0]),
    "Queue: longest wait": ({"instance"}, lambda v: len(v) == 1 and 0 <= v[0] < 120),
    "Queue: longest wait per user": ({"user"}, lambda v: len(v) == 1 and 0 <= v[0] < 120),
    "GPU utilization": ({"instance", "gpu", "uuid", "name", "host"},
                        lambda v: sorted(v) == [0.0, 0.0, 80.0]),
    "GPU memory used": ({"instance", "gpu", "uuid"}, lambda v: sorted(v) == [0.0, 0.0, 0.5]),
    "Sampling OK": (set(), lambda v: v == [1.0]),
}


@needs_prometheus
@pytest.mark.parametrize("instance", [None, "one"])
def test_every_dashboard_query_returns_what_its_panel_shows(lab: Lab, instance: str | None):
    targets = dashboard_targets()
    assert {title for title, _ in targets} == set(EXPECTED) | {"Leased but idle (over 10 minutes)"}
    for title, expr in targets:
        filled = fill(expr, lab.target if instance == "one" else None)
        if title == "Leased but idle (over 10 minutes)":
            # idle for seconds here, not ten minutes: the threshold keeps it out; without it,
            # the table's rows are there with the columns it shows
            assert query(lab.base, filled) == []
            filled = filled.rsplit(">", 1)[0]
            rows = sorted(query(lab.base, filled), key=lambda r: r["metric"]["gpu"])
            assert [(r["metric"]["user"], r["metric"]["job_id"], r["metric"]["gpu"])
                    for r in rows] == [("root", JOB_ID, "0"), ("root", "812_3", "1")], rows
            assert rows[1]["value"][1] == "0"  # GPU 1 is busy: idle for 0 s
            continue
        labels, check = EXPECTED[title]
        rows = query(lab.base, filled)
        assert rows, (title, filled)
        for row in rows:
            assert labels <= set(row["metric"]), (title, row)
            assert all(row["metric"][k] for k in labels - {"job_id"}), (title, row)
        values = sorted(float(r["value"][1]) for r in rows)
        assert check(values), (title, filled, rows)
    holders = query(lab.base, fill(dict(targets)["Who holds what"], None))
    assert sorted(r["metric"]["job_id"] for r in holders) == ["812_3", JOB_ID]


@needs_prometheus
def test_the_host_variable_and_the_scrape_labels(lab: Lab):
    hosts = api(lab.base, "/api/v1/label/instance/values", **{"match[]": "devicekit_info"})
    assert hosts == [lab.target]
    (up,) = query(lab.base, 'up{job="devicekit"}')
    assert up["value"][1] == "1" and up["metric"]["host"] == "127.0.0.1"
    # the job id is never renamed: no exported_job, and job is the scrape job's
    (row,) = query(lab.base, f'devicekit_lease_holders{{job_id="{JOB_ID}"}}')
    assert row["metric"]["job"] == "devicekit" and "exported_job" not in row["metric"]


@needs_prometheus
def test_the_alert_rules_load_and_stay_quiet_here(lab: Lab):
    groups = _wait("the rules evaluated", lambda: [
        g for g in api(lab.base, "/api/v1/rules")["groups"]
        if all(r.get("lastEvaluation", "").startswith("2") and r["health"] == "ok"
               for r in g["rules"])])
    names = {r["name"] for g in groups for r in g["rules"]}
    assert names == {"DevicekitLeasedGpuIdle", "DevicekitQueueWaitOverAnHour",
                     "DevicekitLeaseDirectoryProblem", "DevicekitSamplingFails",
                     "DevicekitServeDown"}
    assert api(lab.base, "/api/v1/alerts")["alerts"] == []  # nothing is wrong yet


#: the labels a scrape of one host gives every series (docs/lab/prometheus.yml's relabelling)
SCRAPED = {"instance": "gpu1:9400", "job": "devicekit", "host": "gpu1", "lab": "vision"}
LEASE = {"gpu": "0", "uuid": "GPU-0", "user": "alice", "kind": "lease", "job_id": "bert-7"}


def series(name: str, **labels: str) -> str:
    """``name{...}`` as scraped from gpu1 (the scrape's labels first)."""
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in {**SCRAPED, **labels}.items()) + "}"


RULE_TESTS = {
    "evaluation_interval": "1m",
    "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": series("devicekit_lease_idle_seconds", **LEASE), "values": "1500+60x10"},
            {"series": series("devicekit_queue_wait_seconds"), "values": "3500+60x10"},
            {"series": series("devicekit_lease_directory_problems"), "values": "0 1x10"},
            {"series": series("devicekit_sample_ok"), "values": "1 0x10"},
            {"series": series("up"), "values": "1 0x10"},
        ],
        "alert_rule_test": [
            {"eval_time": "4m", "alertname": "DevicekitLeasedGpuIdle", "exp_alerts": []},
            {"eval_time": "6m", "alertname": "DevicekitLeasedGpuIdle", "exp_alerts": [{
                "exp_labels": {**SCRAPED, **LEASE, "severity": "warning"},
                "exp_annotations": {
                    "summary": "GPU 0 on gpu1:9400 is leased by alice (job bert-7) and idle "
                               "for 31m 0s",
                    "description": "Ask alice to end job bert-7 (devicekit status on the host "
                                   "shows its pid and command), or let it be if it is about "
                                   "to start."}}]},
            {"eval_time": "1m", "alertname": "DevicekitQueueWaitOverAnHour", "exp_alerts": []},
            {"eval_time": "2m", "alertname": "DevicekitQueueWaitOverAnHour", "exp_alerts": [{
                "exp_labels": {**SCRAPED, "severity": "warning"},
                "exp_annotations": {
                    "summary": "A job has waited 1h 0m 20s for GPUs on gpu1:9400",
                    "description": "devicekit queue on the host says who waits for what and "
                                   "why; idle leases (DevicekitLeasedGpuIdle) are the first "
                                   "place to look."}}]},
            {"eval_time": "5m", "alertname": "DevicekitLeaseDirectoryProblem", "exp_alerts": []},
            {"eval_time": "6m", "alertname": "DevicekitLeaseDirectoryProblem", "exp_alerts": [{
                "exp_labels": {**SCRAPED, "severity": "critical"},
                "exp_annotations": {
                    "summary": "The lease directory on gpu1:9400 has 1 problem(s)",
                    "description": "Run devicekit doctor on the host; the warnings in devicekit "
                                   "status (and the status page) name the file and the "
                                   "owner."}}]},
            {"eval_time": "5m", "alertname": "DevicekitSamplingFails", "exp_alerts": []},
            {"eval_time": "6m", "alertname": "DevicekitSamplingFails", "exp_alerts": [{
                "exp_labels": {**SCRAPED, "severity": "warning"},
                "exp_annotations": {
                    "summary": "devicekit serve on gpu1:9400 cannot read its GPUs",
                    "description": "The numbers are the last good ones; the status page shows "
                                   "the error."}}]},
            {"eval_time": "5m", "alertname": "DevicekitServeDown", "exp_alerts": []},
            {"eval_time": "6m", "alertname": "DevicekitServeDown", "exp_alerts": [{
                "exp_labels": {**SCRAPED, "severity": "warning"},
                "exp_annotations": {
                    "summary": "devicekit serve on gpu1:9400 does not answer scrapes"}}]},
        ],
    }],
}


@needs_prometheus
def test_each_alert_fires_on_its_condition_with_the_right_labels(tmp_path: Path):
    """``promtool test rules``: each alert stays quiet before its condition, fires after it
    (its ``for`` included), and its annotations name the lease's user and job id."""
    tests = {"rule_files": [str(LAB / "alerts.yml")], **RULE_TESTS}
    path = tmp_path / "alerts_test.yml"
    path.write_text(json.dumps(tests))  # JSON is YAML
    done = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    tested = {t["alertname"] for t in RULE_TESTS["tests"][0]["alert_rule_test"]}
    assert tested == {r["alert"] for g in _rules()["groups"] for r in g["rules"]}


def _rules() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    return dict(yaml.safe_load((LAB / "alerts.yml").read_text()))
