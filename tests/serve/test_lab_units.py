"""The lab's parts without a network: host addresses, the hosts list (flag, variable, file),
and the choice of a host from checked documents (selection's filters, blocked and reserved
GPUs, hosts that did not answer)."""

from __future__ import annotations

import json
import time

import pytest

from devicekit.errors import InvalidValueError
from devicekit.selection.gpu_request import make_request
from devicekit.serve.lab import HostAnswer, lab_document
from devicekit.serve.lab_choice import choose_host, start_command
from devicekit.serve.lab_hosts import hosts_file, lab_hosts
from devicekit.serve.peer_document import decode_status
from devicekit.serve.peer_fetch import PeerAddress


@pytest.mark.parametrize("text, host, port, label", [
    ("gpu3", "gpu3", 9400, "gpu3"),
    ("GPU3.lab.example:9400", "gpu3.lab.example", 9400, "gpu3.lab.example"),
    ("gpu3:9500", "gpu3", 9500, "gpu3:9500"),
    ("http://gpu3:9401/", "gpu3", 9401, "gpu3:9401"),
    ("10.0.0.7:9400", "10.0.0.7", 9400, "10.0.0.7"),
    ("[fd00::7]:9500", "fd00::7", 9500, "[fd00::7]:9500"),
])
def test_addresses(text, host, port, label):
    peer = PeerAddress.parse(text)
    assert (peer.host, peer.port, peer.label) == (host, port, label)


@pytest.mark.parametrize("text, words", [
    ("gpu3:99999", "port outside"), ("gpu 3", "is not HOST:PORT"),
    ("https://gpu3", "must be http://"), ("http://gpu3:9400/api/status", "no path"),
    ("gpu3\x1b[2J", "is not HOST:PORT"),
])
def test_bad_addresses_are_one_inert_line(text, words):
    with pytest.raises(InvalidValueError, match=words) as info:
        PeerAddress.parse(text)
    assert "\x1b" not in str(info.value) and "\n" not in str(info.value)


def test_hosts_from_flag_variable_then_file(tmp_path):
    env = {"DEVICEKIT_HOSTS": "b:1, c:2", "XDG_CONFIG_HOME": str(tmp_path)}
    assert [p.label for p in lab_hosts(["a:1,a:1", "d"], env)] == ["a:1", "d"]
    assert [p.label for p in lab_hosts([""], env)] == ["b:1", "c:2"]
    assert hosts_file({"XDG_CONFIG_HOME": str(tmp_path)}) == tmp_path / "devicekit" / "hosts"
    env.pop("DEVICEKIT_HOSTS")
    with pytest.raises(InvalidValueError, match="no hosts given: use --hosts"):
        lab_hosts([], env)
    path = hosts_file(env)
    path.parent.mkdir()
    path.write_text("# lab\ne:3  # comment\n\nf\n")
    assert [p.label for p in lab_hosts([], env)] == ["e:3", "f"]
    path.write_text("e:3\nnot a/host\n")
    with pytest.raises(InvalidValueError, match=r"hosts line 2: host 'not' .*|line 2"):
        lab_hosts([], env)
    path.write_text("# nothing\n")
    with pytest.raises(InvalidValueError, match="lists no hosts"):
        lab_hosts([], env)
    with pytest.raises(InvalidValueError, match="--peer needs HOST:PORT"):
        lab_hosts([""], env, option="--peer", fallback=False)


def _doc(gpus, queue=None):
    doc = {"schema": 1, "taken_at": time.time(), "host": {"hostname": "h"}, "gpus": [
        {"index": i, "uuid": f"GPU-{i}", "name": "H100", "memory_total": 80 * 2**30,
         "memory_used": 0, "memory_free": 80 * 2**30, "utilization": 0, **g}
        for i, g in enumerate(gpus)]}
    if queue is not None:
        doc["queue"] = queue
    return decode_status(json.dumps(doc).encode())


def _answer(label, doc=None, error=None):
    return HostAnswer(PeerAddress.parse(label), doc, error, time.time() if doc else None)


def test_choice_judges_each_host_with_selections_filters():
    lease = {"gpu_uuid": "GPU-0", "pid": 9, "user": "bob", "since": time.time(), "job": "j"}
    answers = [
        _answer("a:1", _doc([{"leases": [lease]}, {}])),                     # 1 free
        _answer("b:1", _doc([{}, {"blocked": "squatted by eve"}, {}],        # 1 free
                            queue=[{"ticket": "4", "user": "dave", "gpus_asked": 1,
                                    "reserved_uuids": ["GPU-2"], "since": time.time() - 60}])),
        _answer("c:1", _doc([{}, {"memory_used": 70 * 2**30, "memory_free": 10 * 2**30}, {}])),
        _answer("d:1", error="connection refused"),
    ]
    choice = choose_host(answers, make_request(2, min_free_memory="20GiB"))
    assert choice.best is not None and choice.best.label == "c:1"
    assert choice.best.value() == "GPU-0,GPU-2" and choice.best.value("index") == "0,2"
    assert start_command(choice.best) == "ssh c devicekit run --gpu-ids GPU-0,GPU-2 -- COMMAND"
    why = {v.label: v.why for v in choice.others}
    assert why["a:1"].startswith("1 of 2 GPU(s) qualify: GPU 0: leased by bob")
    assert "GPU 1: blocked: squatted by eve" in why["b:1"]
    assert "GPU 2: reserved for ticket 4 (dave, 1 GPU(s))" in why["b:1"]
    assert why["d:1"] == "no answer: connection refused"
    none = choose_host(answers, make_request(3, min_free_memory="20GiB"))
    assert none.best is None and len(none.others) == 4


def test_the_best_host_has_the_most_free_memory_first_on_a_tie():
    half = {"memory_used": 40 * 2**30, "memory_free": 40 * 2**30}
    answers = [_answer("a:1", _doc([half, {}])), _answer("b:1", _doc([{}, {}])),
               _answer("c:1", _doc([{}, {}]))]
    choice = choose_host(answers, make_request(2))
    assert choice.best.label == "b:1"
    assert [v.why for v in choice.others] == ["", ""]  # they qualify too


def test_lab_document_says_age_and_error():
    doc = _doc([{}])
    now = time.time()
    lab = lab_document([HostAnswer(None, doc, None, now - 5, local=True),
                        _answer("b:1", error="no answer within 3 s")], now=now)
    local, other = lab["hosts"]
    assert local["host"] == "h" and local["local"] and local["age"] == pytest.approx(5)
    assert other == {"host": "b:1", "url": "http://b:1/", "local": False, "ok": False,
                     "error": "no answer within 3 s", "fetched_at": None, "age": None,
                     "status": None}


def test_a_real_status_document_decodes_whole(simulate, tmp_path, monkeypatch):
    """What this version's ``status --json`` writes (MIG instances, a lease on one with a job,
    a process, the host's facts) passes the peer schema field for field."""
    from devicekit.sharing.leases import Lease
    from devicekit.sharing.machine_status import collect_status
    from tests.conftest import h100

    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(tmp_path / "leases"))
    (tmp_path / "leases").mkdir()
    simulate([h100(util=7, processes=[{"pid": 4242, "user": "alice", "memory": "2GiB",
                                       "command": "python train.py " + "x" * 500}]),
              h100(mig=[{"name": "1g.10gb", "memory_total": "10GiB"},
                        {"name": "3g.40gb", "memory_total": "40GiB", "memory_used": "1GiB"}])])
    status = collect_status().to_dict()
    mig_uuid = status["gpus"][1]["mig_devices"][0]["uuid"]
    lease = Lease.acquire([mig_uuid], directory=tmp_path / "leases", job="bert-7",
                          command="python mig.py")
    try:
        status = collect_status().to_dict()
    finally:
        lease.release()
    doc = decode_status(json.dumps(status).encode())
    assert [g["uuid"] for g in doc["gpus"]] == [g["uuid"] for g in status["gpus"]]
    assert doc["gpus"][0]["processes"][0]["command"] == ("python train.py " + "x" * 500)[:300]
    migs = doc["gpus"][1]["mig_devices"]
    assert len(migs) == len(status["gpus"][1]["mig_devices"]) and migs[0]["uuid"] == mig_uuid
    assert [x["job"] for x in migs[0]["leases"]] == ["bert-7"]
    assert doc["gpus"][1]["leases"][0]["gpu_uuid"] == mig_uuid
    assert doc["host"]["hostname"] == status["host"]["hostname"]
    assert doc["host"]["load_average"] == status["host"]["load_average"]
