"""performance_mode / deterministic_mode set the switches together and restore them."""

from __future__ import annotations

import os

import pytest
import torch

import devicekit as dk
from devicekit.placement.modes import CUBLAS_ENV, BackendFlags


@pytest.fixture(autouse=True)
def restore_flags(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.delenv(CUBLAS_ENV, raising=False)
    before = BackendFlags.capture()
    yield
    before.apply()


def test_performance_mode_sets_all_switches_and_undo_restores() -> None:
    before = BackendFlags.capture()
    handle = dk.performance_mode()
    now = BackendFlags.capture()
    assert now.cudnn_benchmark and not now.deterministic_algorithms and not now.cudnn_deterministic
    assert now.tf32["float32_matmul_precision"] == "high" and now.tf32["cudnn_allow_tf32"] is True
    handle.undo()
    assert BackendFlags.capture() == before
    handle.undo()  # a second undo does nothing
    assert BackendFlags.capture() == before


def test_deterministic_mode_as_context_manager() -> None:
    before = BackendFlags.capture()
    with dk.deterministic_mode() as handle:
        now = BackendFlags.capture()
        assert not now.cudnn_benchmark and now.cudnn_deterministic
        assert torch.are_deterministic_algorithms_enabled()
        assert now.tf32["float32_matmul_precision"] == "highest" and now.tf32["cudnn_allow_tf32"] is False
        assert os.environ[CUBLAS_ENV] == ":4096:8"
        assert any(CUBLAS_ENV in line for line in handle.advice)
    assert BackendFlags.capture() == before
    assert CUBLAS_ENV not in os.environ


def test_modes_nest_and_unwind_in_order() -> None:
    before = BackendFlags.capture()
    with dk.performance_mode():
        inside = BackendFlags.capture()
        with dk.deterministic_mode(warn_only=True):
            assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert BackendFlags.capture() == inside
    assert BackendFlags.capture() == before


def test_existing_cublas_config_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CUBLAS_ENV, ":16:8")
    with dk.deterministic_mode() as handle:
        assert os.environ[CUBLAS_ENV] == ":16:8"
        assert not any(CUBLAS_ENV in line for line in handle.advice)
    assert os.environ[CUBLAS_ENV] == ":16:8"


def test_restored_on_exception() -> None:
    before = BackendFlags.capture()
    with pytest.raises(KeyError), dk.deterministic_mode():
        raise KeyError("boom")
    assert BackendFlags.capture() == before


def legacy_tf32_reads() -> tuple[bool, bool, str]:
    return (bool(torch.backends.cuda.matmul.allow_tf32), bool(torch.backends.cudnn.allow_tf32),
            torch.get_float32_matmul_precision())


def test_every_reader_of_the_tf32_switches_still_works_in_each_mode() -> None:
    # Setting only torch >= 2.9's fp32_precision switches made torch raise "mix of the legacy
    # and new APIs" for every later reader of allow_tf32 (torch.compile's Inductor, Lightning).
    with dk.performance_mode():
        assert legacy_tf32_reads() == (True, True, "high")
    with dk.deterministic_mode():
        assert legacy_tf32_reads() == (False, False, "highest")


def test_user_tf32_choices_survive_a_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_float32_matmul_precision("medium")  # faster than TF32: performance mode keeps it
    with dk.performance_mode():
        assert torch.get_float32_matmul_precision() == "medium"
    with dk.deterministic_mode():
        assert torch.get_float32_matmul_precision() == "highest"
    assert torch.get_float32_matmul_precision() == "medium"
