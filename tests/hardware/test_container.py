"""Containers: a PID namespace of its own hides who uses the GPUs; status and doctor say so
(issue 14, item 9). A fake /proc stands in for the container's."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from devicekit.cli.main import main
from devicekit.hardware import container
from devicekit.hardware.container import HOST_PID_NAMESPACE, pid_isolation
from tests.conftest import h100

ALICE = {"pid": 4242, "user": "alice", "memory": "2GiB", "command": "python train.py"}


def fake_proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inode: int,
              pids: tuple[int, ...] = (1,), cgroup: str = "0::/\n") -> Path:
    proc = tmp_path / "proc"
    (proc / "self" / "ns").mkdir(parents=True)
    os.symlink(f"pid:[{inode}]", proc / "self" / "ns" / "pid")  # readlink only, never followed
    for pid in pids:
        (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / "1" / "cgroup").write_text(cgroup)
    monkeypatch.setattr(container, "PROC", proc)
    monkeypatch.setattr(container, "ROOT", tmp_path)
    return proc


def test_host_namespace_hides_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_proc(tmp_path, monkeypatch, HOST_PID_NAMESPACE, pids=(1, 4242))
    iso = pid_isolation([4242], environ={})
    assert iso.own_namespace is False and iso.foreign_pids == () and iso.note() is None


def test_own_namespace_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_proc(tmp_path, monkeypatch, 4026532518, cgroup="0::/kubepods/burstable/pod1\n")
    (tmp_path / ".dockerenv").write_text("")
    iso = pid_isolation([], environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    assert iso.own_namespace is True
    assert iso.note() is not None and "PID namespace of its own" in iso.note()
    assert "lease" in iso.note()
    assert set(iso.hints) == {str(tmp_path / ".dockerenv"), "KUBERNETES_SERVICE_HOST",
                              "kubepods in /proc/1/cgroup"}


def test_nvml_pids_missing_here_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_proc(tmp_path, monkeypatch, HOST_PID_NAMESPACE, pids=(1,))
    iso = pid_isolation([4242, 1], environ={})
    assert iso.foreign_pids == (4242,)
    assert "pid(s) 4242 that do not exist here" in (iso.note() or "")


def test_a_docker_hint_alone_is_not_a_container(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A VM built from a container image has /.dockerenv but the host's PID namespace."""
    fake_proc(tmp_path, monkeypatch, HOST_PID_NAMESPACE)
    (tmp_path / ".dockerenv").write_text("")
    iso = pid_isolation([], environ={})
    assert iso.hints and iso.note() is None


def test_no_proc_cannot_tell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(container, "PROC", tmp_path / "nothing")
    assert pid_isolation([1], environ={}).own_namespace is None


def test_status_and_doctor_say_so_in_a_container(simulate: Callable[..., Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    simulate([h100(used="2GiB", processes=[ALICE])])
    fake_proc(tmp_path, monkeypatch, 4026532518)
    with pytest.raises(SystemExit):
        main(["status", "--json"])
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert any("PID namespace of its own" in w for w in warnings), warnings
    with pytest.raises(SystemExit):
        main(["status"])
    assert "PID namespace of its own" in capsys.readouterr().out.replace("\n", " ").replace("  ", " ")
    with pytest.raises(SystemExit):
        main(["doctor", "--json", "--no-torch"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["pid_namespace"]["status"] == "warn"
    assert "lease directory" in checks["pid_namespace"]["message"]


def test_status_on_the_host_has_no_such_warning(simulate: Callable[..., Path], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    simulate([h100(used="2GiB", processes=[ALICE])])  # pid 4242 is made up: not a foreign pid
    fake_proc(tmp_path, monkeypatch, HOST_PID_NAMESPACE)
    with pytest.raises(SystemExit):
        main(["status", "--json"])
    assert not json.loads(capsys.readouterr().out)["warnings"]
