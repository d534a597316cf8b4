"""``devicekit serve`` end to end over HTTP: /metrics, /api/status and / agree with
``devicekit status --json``, hostile text is inert, and it is read-only."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

import devicekit as dk
from devicekit.cli.main import main
from devicekit.serve.prometheus import GPU_GAUGES
from devicekit.sharing.leases import Lease
from tests.serve.conftest import ALICE, HOSTILE_COMMAND, HOSTILE_USER, get, get_json, wait_for


def status_json(capsys) -> dict:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["status", "--json"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 0, err
    return json.loads(out)


def samples(text: str) -> dict[str, list]:
    """metric sample name -> [(labels, value)] via prometheus-client's own parser."""
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def one(found: dict[str, list], metric: str, **labels: str) -> float:
    values = [v for lab, v in found.get(metric, [])
              if all(lab.get(k) == x for k, x in labels.items())]
    assert len(values) == 1, (metric, labels, found.get(metric))
    return values[0]


@pytest.fixture
def leased(server):
    """GPU 1 leased by this process; waits until the server's snapshot shows it."""
    uuid = dk.gpus()[1].uuid
    with Lease.acquire([uuid], memory=8 * 2**30, command="python mine.py") as lease:
        wait_for(server, lambda s: any(g["leases"] for g in s.status["gpus"]))
        yield lease


def test_metrics_parse_and_equal_status_json(server, leased, capsys):
    status, headers, body = get(server, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    found = samples(body.decode())
    doc = status_json(capsys)  # a separate `devicekit status --json`, as a user would run it
    host = doc["host"]["hostname"]
    assert one(found, "devicekit_gpus") == len(doc["gpus"]) == 3
    for gpu in doc["gpus"]:
        labels = {"gpu": str(gpu["index"]), "uuid": gpu["uuid"], "name": gpu["name"],
                  "hostname": host}
        for metric, (key, _) in GPU_GAUGES.items():
            if gpu[key] is None:  # unknown stays unknown, never 0
                assert not [v for lab, v in found.get(metric, []) if lab == labels], metric
            else:
                assert one(found, metric, **labels) == gpu[key], metric
        assert one(found, "devicekit_gpu_processes", **labels) == len(gpu["processes"])
        assert one(found, "devicekit_gpu_leases", **labels) == len(gpu["leases"])
    (lease,) = doc["gpus"][1]["leases"]
    user = lease["user"]
    lease_labels = {"gpu": "1", "uuid": lease["gpu_uuid"], "user": user, "kind": "lease",
                    "job_id": lease["job"]}
    assert lease["job"]  # every lease carries its job id (here: this process's generated one)
    assert one(found, "devicekit_lease_holders", **lease_labels) == 1
    assert one(found, "devicekit_lease_since_timestamp_seconds", **lease_labels) == lease["since"]
    assert one(found, "devicekit_lease_idle_seconds", **lease_labels) == 0  # GPU 1 is 90 % busy
    assert one(found, "devicekit_user_leased_devices", user=user) == 1
    assert one(found, "devicekit_user_gpu_memory_bytes", user="alice") == 2 * 2**30
    assert one(found, "devicekit_user_processes", user=HOSTILE_USER) == 1
    assert one(found, "devicekit_sample_ok") == 1
    assert one(found, "devicekit_queue_waiting_jobs") == 0
    # bounded cardinality: no label carries a pid or a command line
    labels_seen = {k for rows in found.values() for lab, _ in rows for k in lab}
    assert labels_seen <= {"gpu", "uuid", "name", "hostname", "user", "kind", "job_id", "mig",
                           "version", "backend", "driver_version", "cuda_driver_version"}
    values_seen = {v for rows in found.values() for lab, _ in rows for v in lab.values()}
    assert not any("python" in v or v in ("4242", "666") for v in values_seen)


def test_api_status_is_the_status_json_document(server, leased, capsys):
    status, headers, body = get(server, "/api/status")
    assert status == 200 and headers["Content-Type"] == "application/json"
    served = json.loads(body)
    assert body.endswith(b"}\n") and body.count(b"\n") > 50  # printed as `status --json` prints
    doc = status_json(capsys)
    assert set(served) == set(doc)
    for gpu in served["gpus"]:  # serve's one addition: since when each leased GPU is idle
        for lease in gpu["leases"]:
            assert lease.pop("idle_since") is None or gpu["utilization"] < 5
    for key in ("schema", "devicekit_version", "backend", "driver_version", "gpus",
                "other_leases", "warnings"):
        assert served[key] == doc[key], key
    assert set(served["host"]) == set(doc["host"])
    assert served["host"]["hostname"] == doc["host"]["hostname"]


def test_page_shows_every_gpu_and_the_lease_holder(server, leased):
    status, headers, body = get(server, "/")
    page = body.decode()
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    for gpu in server.sampler.snapshot.status["gpus"]:
        assert f'data-uuid="{gpu["uuid"]}"' in page
    lease = server.sampler.snapshot.status["gpus"][1]["leases"][0]
    assert f'leased by <b class="user">{lease["user"]}</b>' in page
    assert "python mine.py" in page and "8 GiB asked" in page
    assert ALICE["command"] in page and "51 &deg;C" in page and "250 / 700 W" in page
    # works offline: no external asset, and the assets it names are served
    assert "http://" not in page.replace('href="/', "") and "https://" not in page
    for asset in ("/static/page.css", "/static/page.js"):
        assert asset in page and get(server, asset)[0] == 200
    assert 'name="viewport"' in page  # readable on a phone


def test_page_updates_when_a_lease_starts(server):
    uuid = dk.gpus()[2].uuid
    _, _, before = get(server, "/fragment")
    assert b"leased by" not in before
    with Lease.acquire([uuid], command="python later.py"):
        wait_for(server, lambda s: any(g["leases"] for g in s.status["gpus"]))
        _, _, during = get(server, "/fragment")
    assert b"leased by" in during and b"python later.py" in during
    wait_for(server, lambda s: not any(g["leases"] for g in s.status["gpus"]))
    assert b"leased by" not in get(server, "/fragment")[2]


def test_hostile_text_is_inert(server):
    for path in ("/", "/fragment"):
        status, headers, body = get(server, path)
        page = body.decode()
        assert status == 200
        assert "<script>alert" not in page and "<img" not in page and "<b>mallory" not in page
        assert "\x1b" not in page and "\x07" not in page
        # shown, as text: the escapes visible, the markup escaped
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "\\x1b[2J" in page
        assert "&lt;b&gt;mallory&lt;/b&gt;" in page
        assert "script-src 'self'" in headers["Content-Security-Policy"]
        assert headers["X-Content-Type-Options"] == "nosniff"
    api = get(server, "/api/status")[2].decode()
    assert "\x1b" not in api and json.loads(api)["gpus"][0]["processes"][1]["command"] == HOSTILE_COMMAND


def test_hide_commands(simulate):
    from devicekit.serve import StatusServer
    from tests.serve.conftest import machine

    simulate(machine())
    with StatusServer("127.0.0.1", 0, interval=0.2, hide_commands=True) as srv, \
            Lease.acquire([dk.gpus()[1].uuid], command="python secret.py"):
        wait_for(srv, lambda s: any(g["leases"] for g in s.status["gpus"]))
        for path in ("/", "/fragment", "/api/status", "/metrics"):
            body = get(srv, path)[2].decode()
            assert "train.py" not in body and "secret.py" not in body and "alert" not in body, path
        doc = get_json(srv)
        assert doc["gpus"][0]["processes"][0] == {**doc["gpus"][0]["processes"][0],
                                                  "command": None, "user": "alice"}
        assert "<i>hidden</i>" in get(srv, "/")[2].decode()


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_read_only(server, method):
    status, headers, _ = get(server, "/api/status", method=method)
    assert status == 405 and headers["Allow"] == "GET, HEAD"


def test_unknown_path_and_head(server):
    assert get(server, "/../../etc/passwd")[0] == 404
    assert get(server, "/metrics?x=<script>")[0] == 200
    status, headers, body = get(server, "/metrics", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
