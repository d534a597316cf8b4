import sys
import types
import warnings

import pytest

from devicekit.errors import VisibleDevicesError
from devicekit.hardware.gpu import GPU
from devicekit.hardware.inventory import gpus
from devicekit.hardware.visible import (
    DeviceOrderWarning,
    cuda_order,
    enumeration_order,
    ordering_note,
    torch_ordinal,
    visible_devices,
    visible_value,
)
from tests.conftest import h100

U = ["GPU-aaaa1111-0000-0000-0000-000000000000", "GPU-bbbb2222-0000-0000-0000-000000000000",
     "GPU-aaaa3333-0000-0000-0000-000000000000"]
MIG = "MIG-11112222-3333-4444-5555-666677778888"


@pytest.fixture
def three(simulate):
    simulate([h100(uuid=U[0]), h100(uuid=U[1]), h100(uuid=U[2], mig=[
        {"name": "1g.10gb", "memory_total": "10GiB", "uuid": MIG}])])
    return gpus()


def ordinals(env):
    return [(d.ordinal, d.gpu.index) for d in visible_devices(env=env)]


def test_unset_means_all_in_pci_order(three):
    assert ordinals({}) == [(0, 0), (1, 1), (2, 2)]


@pytest.mark.parametrize("value", ["", " ", "-1", "NoDevFiles"])
def test_empty_and_minus_one_hide_everything(three, value):
    assert visible_devices(env={"CUDA_VISIBLE_DEVICES": value}) == []


def test_indices_reorder(three):
    assert ordinals({"CUDA_VISIBLE_DEVICES": "2,0"}) == [(0, 2), (1, 0)]
    assert ordinals({"CUDA_VISIBLE_DEVICES": " 1 , 0 "}) == [(0, 1), (1, 0)]


def test_trailing_comma_hides_nothing(three):
    """CUDA stops at the empty last entry, after every GPU listed: nothing is lost, no error."""
    assert ordinals({"CUDA_VISIBLE_DEVICES": "2,0,"}) == [(0, 2), (1, 0)]
    assert ordinals({"CUDA_VISIBLE_DEVICES": f"{U[1]}, "}) == [(0, 1)]
    with pytest.raises(VisibleDevicesError, match="entry ''"):  # in the middle it hides GPU 1
        visible_devices(env={"CUDA_VISIBLE_DEVICES": "0,,1"})


def test_negative_entry_ends_the_list(three):
    assert ordinals({"CUDA_VISIBLE_DEVICES": "1,-1,0"}) == [(0, 1)]


def test_full_and_short_uuids(three):
    assert ordinals({"CUDA_VISIBLE_DEVICES": f"{U[1]},{U[0]}"}) == [(0, 1), (1, 0)]
    assert ordinals({"CUDA_VISIBLE_DEVICES": "GPU-bbbb,GPU-aaaa3"}) == [(0, 1), (1, 2)]
    assert ordinals({"CUDA_VISIBLE_DEVICES": U[2].upper()}) == [(0, 2)]


def test_mig_uuids(three):
    (dev,) = visible_devices(env={"CUDA_VISIBLE_DEVICES": MIG})
    assert dev.gpu.index == 2 and dev.mig is not None and dev.uuid == MIG
    (legacy,) = visible_devices(env={"CUDA_VISIBLE_DEVICES": f"MIG-{U[2]}/0/0"})
    assert legacy.mig == dev.mig


@pytest.mark.parametrize("value,entry,why,kept", [
    ("0,zz,1", "zz", "is not a GPU index", "only GPU(s) 0"),
    ("7", "7", "this machine has 3 GPU(s)", "no GPU would be visible"),
    ("GPU-aaaa", "GPU-aaaa", "matches several GPUs", "no GPU"),
    ("1,GPU-ffff", "GPU-ffff", "matches no GPU's UUID", "only GPU(s) 1"),
    ("MIG-0000", "MIG-0000", "matches no MIG instance", "no GPU"),
    ("0,0", "0", "already listed", "only GPU(s) 0"),
    ("cuda:0", "cuda:0", "is not a GPU index", "no GPU"),
])
def test_garbage_is_one_line_naming_value(three, value, entry, why, kept):
    with pytest.raises(VisibleDevicesError) as err:
        visible_devices(env={"CUDA_VISIBLE_DEVICES": value})
    text = str(err.value)
    assert "\n" not in text and repr(value) in text and repr(entry) in text
    assert why in text and kept in text and "silently" in text


def test_bad_device_order_named():
    with pytest.raises(VisibleDevicesError, match="CUDA_DEVICE_ORDER='PCI'"):
        cuda_order({"CUDA_DEVICE_ORDER": "PCI"})
    assert cuda_order({}) == "FASTEST_FIRST"
    assert cuda_order({"CUDA_DEVICE_ORDER": "pci_bus_id"}) == "PCI_BUS_ID"


@pytest.fixture
def mixed(simulate):
    simulate([
        {"name": "Tesla T4", "memory_total": "16GiB", "compute_capability": "7.5"},
        {"name": "NVIDIA A100-SXM4-40GB", "memory_total": "40GiB", "compute_capability": "8.0"},
    ])
    return gpus()


def test_fastest_first_differs_from_pci_order_and_warns(mixed):
    assert [g.index for g in enumeration_order(mixed, "FASTEST_FIRST")] == [1, 0]
    assert [g.index for g in enumeration_order(mixed, "PCI_BUS_ID")] == [0, 1]
    assert "PCI_BUS_ID" in ordering_note(mixed, {})
    with pytest.warns(DeviceOrderWarning, match="UUIDs"):
        assert ordinals({"CUDA_VISIBLE_DEVICES": "0"}) == [(0, 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env = {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        assert ordinals(env) == [(0, 0)]
        assert ordering_note(mixed, env) is None
        assert ordinals({"CUDA_VISIBLE_DEVICES": mixed[0].uuid}) == [(0, 0)]  # UUIDs never warn


def test_order_warning_is_given_once_at_the_callers_line(simulate, monkeypatch):
    """Selecting on a mixed machine with indices in CUDA_VISIBLE_DEVICES reaches the ordering
    trap once per GPU and once per call: the user gets one warning, naming their own line."""
    import devicekit as dk

    simulate([h100(compute_capability="9.0"),
              {"name": "NVIDIA A100-SXM4-40GB", "memory_total": "40GiB", "compute_capability": "8.0"}])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own default: what a user's script gets
        selection = dk.select_gpus(2)
        assert len(selection.devices) == 2
        visible_devices()
        selection.release()
    order = [w for w in caught if issubclass(w.category, DeviceOrderWarning)]
    assert len(order) == 1, [str(w.message) for w in order]
    assert order[0].filename == __file__, order[0].filename
    assert "uses indices" in str(order[0].message)


def test_order_warning_left_to_doctor_is_still_given_later(mixed, monkeypatch):
    from devicekit.sharing.doctor_checks import Inventory, check_visible_devices

    env = {"CUDA_VISIBLE_DEVICES": "0"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the check reports the trap itself, without a warning
        assert check_visible_devices(Inventory("simulated", tuple(mixed)), env).status == "pass"
    with pytest.warns(DeviceOrderWarning, match="uses indices"):
        visible_devices(mixed, env)


def test_same_models_need_no_warning(three):
    assert ordering_note(three, {}) is None
    assert [g.index for g in enumeration_order(three)] == [0, 1, 2]


def test_torch_ordinal_from_environment(three, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{U[2]},{U[0]}")
    assert torch_ordinal(three[0]) == 1 and torch_ordinal(three[2]) == 0
    with pytest.raises(VisibleDevicesError, match="not visible in this process"):
        torch_ordinal(three[1])


def real(index, uuid):
    return GPU(index=index, uuid=uuid, name="NVIDIA H100", memory_total=1, memory_used=0,
               memory_free=1, backend="nvml")


def test_torch_ordinal_matches_initialised_cuda_by_uuid(monkeypatch):
    """Once CUDA is up, the env no longer matters: CUDA's own device list is searched by UUID."""
    props = [types.SimpleNamespace(uuid=U[1][4:]), types.SimpleNamespace(uuid=U[0][4:])]
    cuda = types.SimpleNamespace(is_initialized=lambda: True, device_count=lambda: 2,
                                 get_device_properties=lambda i: props[i])
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "garbage-set-after-init")
    assert torch_ordinal(real(0, U[0])) == 1
    assert torch_ordinal(real(1, U[1])) == 0
    with pytest.raises(VisibleDevicesError, match="not among this process's CUDA devices"):
        torch_ordinal(real(2, U[2]))


def test_visible_value_formats(three):
    assert visible_value([three[2], three[0]]) == f"{U[2]},{U[0]}"
    assert visible_value([three[2], three[0]], "index") == "2,0"
    assert visible_value([]) == ""


def test_torch_ordinal_warns_when_fastest_first_must_be_guessed(mixed, monkeypatch):
    with pytest.warns(DeviceOrderWarning, match="estimated"):
        assert torch_ordinal(mixed[1]) == 0
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch_ordinal(mixed[1]) == 1


def test_torch_ordinal_after_is_available_uses_cudas_list(monkeypatch):
    """``torch.cuda.is_available()`` calls cuInit without marking torch initialised: CUDA has
    already read CUDA_VISIBLE_DEVICES, so a value set afterwards must not be trusted."""
    from devicekit.hardware import visible

    props = [types.SimpleNamespace(uuid=U[0][4:]), types.SimpleNamespace(uuid=U[1][4:])]
    cuda = types.SimpleNamespace(is_initialized=lambda: False, device_count=lambda: 2,
                                 get_device_properties=lambda i: props[i])
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(visible, "_driver_initialised", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", U[1])  # set after cuInit: CUDA ignores it
    assert torch_ordinal(real(1, U[1]), gpus=[real(0, U[0]), real(1, U[1])]) == 1
    monkeypatch.setattr(visible, "_driver_initialised", lambda: False)
    assert torch_ordinal(real(1, U[1]), gpus=[real(0, U[0]), real(1, U[1])]) == 0


def test_driver_probe_never_loads_the_driver():
    """Without libcuda already in the process the probe says False and loads nothing."""
    from devicekit.hardware.visible import _driver_initialised

    def loaded() -> bool:
        with open("/proc/self/maps") as maps:
            return "libcuda.so" in maps.read()

    if loaded():
        pytest.skip("libcuda is already loaded in this test process")
    assert _driver_initialised() is False
    assert not loaded()
