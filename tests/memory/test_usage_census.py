"""usage/report are honest on CPU; census names and dedupes; release frees; timeline plots."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit.memory.tensors import CUDA_BLOCK, round_block, total_bytes


def test_cpu_usage_measures_or_says_why_not() -> None:
    rows = dk.memory.usage()
    cpu = rows[-1]
    assert cpu.device == "cpu"
    keeper = torch.ones(1024, 1024)  # 4 MiB of live tensors
    cpu = dk.memory.usage("cpu")[0]
    assert cpu.allocated is not None and cpu.allocated >= keeper.numel() * 4
    assert cpu.process_rss and cpu.process_rss > cpu.allocated // 2
    assert cpu.total and cpu.free and cpu.free <= cpu.total
    assert cpu.reserved is None and cpu.reserved_unused is None  # not zeros that look measured
    assert any("reserved: not applicable" in note for note in cpu.notes)
    assert cpu.to_dict()["notes"]


def test_report_prints_a_table_with_dashes_and_notes() -> None:
    out = io.StringIO()
    rows = dk.memory.report("cpu", file=out)
    text = out.getvalue()
    assert rows[0].device == "cpu"
    assert "cpu (host memory)" in text and "reserved unused" in text
    assert " - " in text and "not applicable" in text


def test_bad_device_is_one_line_error(no_cuda: None) -> None:
    with pytest.raises(dk.InvalidDeviceError, match="'cuda:3' asked but CUDA is not available"):
        dk.memory.usage("cuda:3")
    with pytest.raises(dk.InvalidDeviceError, match="not a device"):
        dk.memory.usage("gpu-zero")


def test_shared_storage_counted_once_and_cuda_rounding() -> None:
    base = torch.ones(1000)
    assert total_bytes([base, base[:10], base.view(10, 100)]) == 4000
    assert round_block(1) == CUDA_BLOCK and round_block(513) == 1024 and round_block(0) == 0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128))
        self.history: list[torch.Tensor] = []


def test_census_names_parameters_gradients_optimizer_state_and_locals() -> None:
    net = Net()
    opt = torch.optim.Adam(net.parameters())
    net.body(torch.randn(4, 64)).sum().backward()
    opt.step()
    net.history.extend(torch.zeros(300) for _ in range(2))
    big_local = torch.zeros(500, 500)
    alias = big_local[0]  # a view: its storage is counted once, under big_local
    assert alias.shape == (500,)
    report = dk.memory.census(top=200)
    by_name = {e.name: e for e in report.by_name}
    assert by_name["net.body.0.weight"].category == "parameter"
    assert by_name["net.body.0.weight.grad"].category == "gradient"
    assert by_name["net.body.1.running_mean"].category == "buffer"
    assert by_name["opt.state[net.body.0.weight].exp_avg"].category == "optimizer state"
    assert by_name["net.history[1]"].category == "attribute"
    local = by_name["big_local"]
    assert local.category == "local" and local.bytes == 500 * 500 * 4
    assert "test_census_names_parameters" in local.where
    assert by_name["alias"].bytes == 0 and by_name["alias"].shared_with == "big_local"
    group = next(g for g in report.by_group if g.shape == (500, 500))
    assert group.count == 1 and group.bytes == 1_000_000
    assert report.by_category["parameter"] >= 64 * 128 * 4
    assert "big_local" in str(report)
    from rich.console import Console

    console = Console(record=True, width=200, file=io.StringIO())
    console.print(report)
    assert "tensors by name" in console.export_text()


def test_census_names_closure_cells_by_referrer() -> None:
    def make() -> object:
        hidden = torch.zeros(77, 77)

        def use() -> torch.Tensor:
            return hidden

        return use

    holder = make()
    report = dk.memory.census(top=500)
    names = [e.name for e in report.by_name if e.shape == (77, 77)]
    assert names == ["closure cell of test_census_names_closure_cells_by_referrer.<locals>.make.<locals>.use"]
    del holder


def test_release_frees_storage_and_reports_it(no_cuda: None) -> None:
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    acts = [torch.ones(1000, 250)]
    freed = dk.release(model, opt, acts)
    expected = (256 * 256 + 256) * 4 * 3 + 1000 * 250 * 4  # weights, grads, momentum, activations
    assert freed.tensors_freed == expected
    assert model.weight.untyped_storage().nbytes() == 0 and model.weight.grad is None
    assert not opt.state and acts[0].untyped_storage().nbytes() == 0
    assert "freed" in str(freed) and "no CUDA" in str(freed)
    with pytest.raises(dk.InvalidValueError, match="cannot free a str"):
        dk.release("model")


def test_empty_cache_says_what_happened(no_cuda: None) -> None:
    result = dk.empty_cache()
    assert result.tensors_freed == 0 and result.returned_to_driver == {}
    assert result.rss_returned is not None


def test_timeline_records_and_plots(tmp_path) -> None:
    with dk.MemoryTimeline("cpu", count_tensors=True) as tl:  # default: CUDA where initialised
        kept = []
        for _ in range(4):
            kept.append(torch.ones(256, 1024))
            tl.step()
    assert [s.step for s in tl.samples] == [0, 1, 2, 3, 4]
    growth = tl.samples[-1].allocated - tl.samples[0].allocated
    assert growth == 4 * 256 * 1024 * 4
    png = tl.plot(tmp_path / "memory.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert tl.save_json(tmp_path / "t.json").exists()
    with pytest.raises(dk.BackendError, match="needs a CUDA device"):
        tl.save_snapshot(tmp_path / "snap.pickle")


def test_timeline_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    tl = dk.MemoryTimeline()
    tl.step()
    with pytest.raises(dk.MissingDependencyError, match="pip install 'devicekit\\[plot\\]'"):
        tl.plot(tmp_path / "x.png")


@pytest.mark.parametrize("already_recording", [False, True])
def test_timeline_leaves_a_users_allocator_history_on(monkeypatch: pytest.MonkeyPatch,
                                                      already_recording: bool) -> None:
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)
    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: already_recording, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kw: calls.append(enabled))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: {"segments": [], "device_traces": []})
    with dk.MemoryTimeline("cuda:0") as tl:
        tl.step()
    # the user's own recording (e.g. for their own snapshot) is not switched off under them
    assert calls == ([] if already_recording else ["all", None])


@pytest.mark.parametrize(("kwargs", "named"), [({"top": -1}, "top=-1"), ({"top": "x"}, "top='x'"),
                                               ({"device": "gpu"}, "device='gpu'")])
def test_census_refuses_arguments_that_would_read_as_zero_tensors(kwargs: dict, named: str) -> None:
    with pytest.raises(dk.DeviceKitError, match=named):
        dk.memory.census(**kwargs)


def test_census_accepts_a_torch_device() -> None:
    keep = torch.ones(7)
    listing = dk.memory.census(top=1000, device=torch.device("cpu"))
    assert any(e.name == "keep" for e in listing.by_name) and keep.numel() == 7


def test_release_of_an_activation_does_not_warn() -> None:
    import warnings

    weight = torch.ones(64, requires_grad=True)
    activation = weight * 2  # not a leaf: reading its .grad makes torch warn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        freed = dk.release(activation)
    assert freed.tensors_freed == 256 and activation.untyped_storage().nbytes() == 0


def test_fake_tensors_left_alive_hold_no_memory() -> None:
    """An estimate's refusal keeps its fake tensors alive in the traceback it chains: one of an
    absurd sample says it is on the CPU with PiB of bytes. They are not memory in use (a later
    test's CPU usage read 512 PB)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from devicekit.memory.usage import cpu_usage

    with FakeTensorMode():
        fake = torch.empty(64, 100000, 100000, 100000)
    assert fake.device.type == "cpu"
    cpu = cpu_usage()
    assert cpu.allocated is not None and cpu.allocated < 1 << 40, cpu.allocated
    del fake
