"""The lab from the command line: three ``devicekit serve`` processes on loopback, each with its
own simulated GPUs, lease directory and leases, read by ``status --hosts`` and ``select --hosts``.

Host A: two GPUs, one leased by job ``alpha``. Host B: three GPUs, none leased (one 95 % busy
and nearly full). Host C: two GPUs, both leased by job ``gamma``. Only B has two free GPUs.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from devicekit.cli.main import main
from devicekit.sharing.leases import Lease
from tests.conftest import h100
from tests.serve.conftest import ServeProcesses, stop_process

CAROL = {"pid": 77, "user": "carol", "memory": "75GiB", "command": "python big.py"}


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def _write(path: Path, gpus: list[dict]) -> Path:
    path.write_text(json.dumps({"gpus": gpus}))
    return path


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The three hosts, started once for this file; yields {name: (process, "127.0.0.1:PORT")};
    leases released and servers stopped afterwards."""
    tmp_path = tmp_path_factory.mktemp("lab")
    layout = {
        "a": [h100(uuid="GPU-a0"), h100(uuid="GPU-a1")],
        "b": [h100(uuid="GPU-b0"), h100(uuid="GPU-b1"),
              h100(used="75GiB", util=95, uuid="GPU-b2", processes=[CAROL])],
        "c": [h100(uuid="GPU-c0"), h100(uuid="GPU-c1")],
    }
    processes = ServeProcesses()
    hosts, leases = {}, []
    try:
        for name, gpus in layout.items():
            leases_dir = tmp_path / f"leases-{name}"
            leases_dir.mkdir()
            if name == "a":
                leases.append(Lease.acquire(["GPU-a0"], directory=leases_dir, job="alpha",
                                            command="python a.py"))
            if name == "c":
                leases.append(Lease.acquire(["GPU-c0", "GPU-c1"], directory=leases_dir,
                                            job="gamma", command="python c.py"))
            proc, url = processes(_write(tmp_path / f"{name}.json", gpus), leases_dir)
            hosts[name] = (proc, url.removeprefix("http://").rstrip("/"))
        yield hosts
    finally:
        processes.stop_all()
        for lease in leases:
            lease.release()


def test_status_hosts_shows_all_three(lab, capsys):
    addresses = ",".join(address for _, address in lab.values())
    code, out, err = run_cli(capsys, "status", "--hosts", addresses)
    assert code == 0, err
    assert "3 of 3 host(s) answered" in out
    for _, address in lab.values():
        assert address in out
    assert "alpha" in out and "gamma" in out and "carol" in out
    code, out, _ = run_cli(capsys, "status", "--hosts", addresses, "--json")
    doc = json.loads(out)
    assert code == 0 and [h["ok"] for h in doc["hosts"]] == [True, True, True]
    a, b, c = (h["status"] for h in doc["hosts"])
    assert [g["uuid"] for g in b["gpus"]] == ["GPU-b0", "GPU-b1", "GPU-b2"]
    assert a["gpus"][0]["leases"][0]["job"] == "alpha" and not a["gpus"][1]["leases"]
    assert {lease["job"] for g in c["gpus"] for lease in g["leases"]} == {"gamma"}


def test_a_stopped_host_is_one_line_and_the_rest_show(lab, capsys, serve_process, tmp_path):
    (tmp_path / "leases-e").mkdir()
    proc, url = serve_process(_write(tmp_path / "e.json", [h100(uuid="GPU-e0")]),
                              tmp_path / "leases-e")
    gone = url.removeprefix("http://").rstrip("/")
    hosts = {**lab, "e": (proc, gone)}
    code, out, _ = run_cli(capsys, "status", "--hosts", gone)
    assert code == 0 and "1 of 1 host(s) answered" in out and "H100" in out
    stop_process(proc)
    repeated = [word for _, address in hosts.values() for word in ("--hosts", address)]
    code, out, err = run_cli(capsys, "status", *repeated)
    assert code == 0, err
    assert "3 of 4 host(s) answered" in out
    down = [line for line in out.splitlines() if gone in line]
    assert len(down) == 1 and "connection refused" in down[0]
    assert all(lab[name][1] in out for name in "abc") and "alpha" in out and "gamma" in out
    code, out, _ = run_cli(capsys, "status", "--hosts", gone, "--json")
    (host,) = json.loads(out)["hosts"]
    assert code == 2 and host["ok"] is False and "connection refused" in host["error"]


def test_a_slow_host_does_not_hold_the_table(lab, capsys):
    with socket.socket() as silent:  # accepts connections (the kernel does), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        slow = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        code, out, err = run_cli(capsys, "status", "--hosts", f"{lab['a'][1]},{slow}",
                                 "--timeout", "1")
        elapsed = time.monotonic() - started
    assert code == 0, err
    assert elapsed < 5, f"the table waited {elapsed:.1f} s for a silent host"
    assert f"{slow}: no answer within 1 s" in out and "alpha" in out


def test_select_hosts_picks_the_host_with_two_free_gpus(lab, capsys):
    addresses = [address for _, address in lab.values()]
    code, out, err = run_cli(capsys, "select", "--hosts", ",".join(addresses), "-n", "2",
                             "--min-free", "20GiB")
    assert code == 0, err
    assert out == "127.0.0.1 GPU-b0,GPU-b1\n"
    lines = err.splitlines()
    assert lines[0].startswith(f"devicekit: chose {lab['b'][1]}: GPU 0 (80 GiB free)")
    assert lines[1] == ("devicekit: start it there: ssh 127.0.0.1 devicekit run --gpu-ids "
                        "GPU-b0,GPU-b1 -- COMMAND")
    others = {line.split()[1].rstrip(":"): line for line in lines[2:]}
    assert set(others) == {lab["a"][1], lab["c"][1]}
    assert "1 of 2 GPU(s) qualify: GPU 0: leased by" in others[lab["a"][1]]
    assert "0 of 2 GPU(s) qualify" in others[lab["c"][1]]
    assert "GPU 1: leased by" in others[lab["c"][1]]


def test_select_hosts_exit_3_when_none_qualifies(lab, capsys, monkeypatch):
    monkeypatch.setenv("DEVICEKIT_HOSTS", " ".join(address for _, address in lab.values()))
    code, out, err = run_cli(capsys, "select", "--hosts", "-n", "3", "--min-free", "20GiB")
    assert code == 3 and out == ""
    assert err.startswith("devicekit: no host has 3 GPU(s) that qualify now\n")
    assert "GPU 2: 5 GiB free < 20 GiB asked" in err  # B's busy GPU, in selection's words
    assert err.count("\n") == 4  # the summary and one line per host


def test_hosts_from_the_hosts_file(lab, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("DEVICEKIT_HOSTS", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    hosts = tmp_path / "config" / "devicekit" / "hosts"
    hosts.parent.mkdir(parents=True)
    hosts.write_text(f"# the lab\n{lab['b'][1]}   # three GPUs\n\n{lab['a'][1]}\n")
    code, out, err = run_cli(capsys, "select", "--hosts", "-n", "2", "-q")
    assert (code, out) == (0, "127.0.0.1 GPU-b0,GPU-b1\n"), err
    code, out, _ = run_cli(capsys, "status", "--hosts", "--json")
    assert [h["host"] for h in json.loads(out)["hosts"]] == [lab["b"][1], lab["a"][1]]


def test_serve_peer_shows_every_host(lab, serve_process, tmp_path):
    """A fourth ``devicekit serve`` with ``--peer`` for the three: /api/lab and /lab show all."""
    peers = [word for _, address in lab.values() for word in ("--peer", address)]
    (tmp_path / "leases-d").mkdir()
    _, url = serve_process(_write(tmp_path / "d.json", [h100(uuid="GPU-d0")]),
                           tmp_path / "leases-d", *peers)
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(url + "api/lab", timeout=10) as response:
            hosts = json.loads(response.read())["hosts"]
        if all(h["ok"] for h in hosts):
            break
        assert time.monotonic() < deadline, hosts
        time.sleep(0.1)
    assert [h["host"] for h in hosts[1:]] == [address for _, address in lab.values()]
    assert hosts[0]["local"] and [g["uuid"] for g in hosts[0]["status"]["gpus"]] == ["GPU-d0"]
    with urllib.request.urlopen(url + "lab", timeout=10) as response:
        page = response.read().decode()
    for uuid in ("GPU-a0", "GPU-b2", "GPU-c1", "GPU-d0"):
        assert f'data-uuid="{uuid}"' in page
    assert "alpha" in page and "gamma" in page and "carol" in page
