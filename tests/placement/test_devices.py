"""try_gpu / try_all_gpus / as_device on this machine, with CUDA faked where a count matters."""

from __future__ import annotations

import pytest
import torch

import devicekit as dk
from devicekit.placement import devices


def test_try_gpu_falls_back_to_cpu_without_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "accelerator_type", lambda: None)
    assert dk.try_gpu() == torch.device("cpu")
    assert dk.try_gpu(10) == torch.device("cpu")
    assert dk.try_all_gpus() == [torch.device("cpu")]


def test_try_gpu_uses_existing_cuda_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "accelerator_type", lambda: "cuda")
    monkeypatch.setattr(devices, "_count", lambda kind: 2)
    assert dk.try_gpu(1) == torch.device("cuda", 1)
    assert dk.try_gpu(2) == torch.device("cpu")
    assert dk.try_all_gpus() == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_try_gpu_picks_mps_where_that_is_the_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "accelerator_type", lambda: "mps")
    monkeypatch.setattr(devices, "_count", lambda kind: 1 if kind == "mps" else 0)
    assert dk.try_gpu() == torch.device("mps", 0)
    assert dk.try_gpu(1) == torch.device("cpu")


def test_try_gpu_rejects_negative_index() -> None:
    with pytest.raises(dk.InvalidDeviceError, match="-1"):
        dk.try_gpu(-1)


@pytest.mark.parametrize("spec", ["cpu", torch.device("cpu"), "meta", " cpu "])
def test_as_device_accepts_host_devices(spec: object) -> None:
    assert dk.as_device(spec).type in ("cpu", "meta")


def test_gpu_spelling_suggests_cuda() -> None:
    with pytest.raises(dk.InvalidDeviceError) as info:
        dk.as_device("gpu:0")
    message = str(info.value)
    assert "'gpu:0'" in message and "'cuda:0'" in message and "\n" not in message


def test_garbage_is_named() -> None:
    with pytest.raises(dk.InvalidDeviceError, match="'potato'"):
        dk.as_device("potato")
    with pytest.raises(dk.InvalidDeviceError, match="float"):
        dk.as_device(1.5)  # type: ignore[arg-type]
    with pytest.raises(dk.InvalidDeviceError, match="negative"):
        dk.as_device(-2)


def test_missing_cuda_index_says_how_many_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_count", lambda kind: 1 if kind == "cuda" else 0)
    monkeypatch.setattr(devices, "_KNOWN_GOOD", {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(dk.InvalidDeviceError) as info:
        dk.as_device("cuda:7")
    message = str(info.value)
    assert "'cuda:7'" in message and "1 cuda device" in message
    assert "CUDA_VISIBLE_DEVICES='3'" in message and "\n" not in message
    assert dk.as_device("cuda:0") == torch.device("cuda", 0)


def test_cuda_on_a_machine_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_count", lambda kind: 0)
    monkeypatch.setattr(devices, "_KNOWN_GOOD", {})
    with pytest.raises(dk.InvalidDeviceError, match="no cuda device.*try_gpu"):
        dk.as_device("cuda")
    with pytest.raises(dk.InvalidDeviceError, match="no cuda device"):
        dk.as_device(0)


def test_invalid_device_error_is_a_devicekit_value_error() -> None:
    with pytest.raises(ValueError):
        dk.as_device("gpu")
    with pytest.raises(dk.DeviceKitError):
        dk.as_device("gpu")


def test_cuda_on_a_cpu_build_blames_the_build_not_the_variable(monkeypatch) -> None:
    import torch

    import devicekit as dk
    from devicekit.errors import InvalidDeviceError

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(InvalidDeviceError, match="CPU-only build; install a CUDA build") as info:
        dk.as_device("cuda:1")
    assert "CUDA_VISIBLE_DEVICES" not in str(info.value)
