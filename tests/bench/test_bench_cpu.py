"""``dk.bench`` and ``devicekit bench`` on a CPU-only machine: CPU figures, a plain "no GPU"
note, the cache, one-line errors. Values are checked for sanity (positive, finite), never timed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import devicekit as dk
from devicekit.cli.main import main
from devicekit.cli.phases import AFTER_ENV
from devicekit.hardware.bench_cache import read_result
from devicekit.measure.devices import bench_devices

pytestmark = pytest.mark.skipif(
    __import__("torch").cuda.is_available(),
    reason="checks the CPU-only behaviour")


def test_quick_json_gives_cpu_figures_and_says_there_is_no_gpu(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # in this interpreter (the command's own code, without a second torch import); a log (no
    # terminal) is told each measurement that lasts (issue 46, item 3): every one, at threshold 0
    monkeypatch.setenv(AFTER_ENV, "0")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--quick", "--json", "--plot", str(tmp_path / "bench.png")])
    out, err = capsys.readouterr()
    assert exit_info.value.code in (0, None), err
    assert any(line.startswith("devicekit bench: cpu matmul") for line in err.splitlines()), err
    doc = json.loads(out)
    assert doc["schema"] == 1 and doc["gpu_count"] == 0 and doc["quick"] is True
    assert any(n.startswith("no GPU:") and "CPU figures only" in n for n in doc["notes"])
    (cpu,) = doc["devices"]
    figures = {f["key"]: f for f in cpu["figures"]}
    for key in ("matmul.fp32.256", "matmul.fp32.1024", "memory.copy", "latency.op",
                "logging.item_per_step", "logging.metric_log", "logging.speedup"):
        assert math.isfinite(figures[key]["value"]) and figures[key]["value"] > 0, key
    assert figures["matmul.fp32.1024"]["threads"] >= 1 and figures["matmul.fp32.1024"]["peak"] is None
    assert (tmp_path / "bench.png").stat().st_size > 1000
    cached = read_result("cpu")
    assert cached is not None and cached["matmul_tflops"]["fp32"] > 0


def test_api_report_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    report = dk.bench(["cpu"], quick=True, progress=True, cache=False)
    assert report.cache_files == [] and report.device("cpu").best("matmul.").unit == "TFLOP/s"
    assert "measurements done" in capsys.readouterr().err  # progress said something
    from io import StringIO

    from devicekit.measure.bench_table import render_report

    out = StringIO()
    render_report(report, out)
    assert "matmul fp32 1024x1024" in out.getvalue() and "GFLOP/s" in out.getvalue()


@pytest.mark.parametrize(("args", "message"), [
    (["--device", "cuda:3"], "device 'cuda:3' does not exist"),
    (["--device", "tpu"], "device 'tpu' is not cpu, cuda"),
    (["--device", "cuda"], "torch sees no CUDA device"),
    (["--plot", "out.nope"], "plot file 'out.nope' has no known image format"),
    (["--plot", "/no/such/dir/b.png"], "folder '/no/such/dir' does not exist"),
    (["--quick=2"], "--quick"),
])
def test_bad_options_are_one_line_errors(args: list[str], message: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from devicekit.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_device_parsing() -> None:
    assert [str(d) for d in bench_devices(None)] == ["cpu"]
    assert [str(d) for d in bench_devices("cpu,cpu")] == ["cpu"]
    with pytest.raises(dk.InvalidDeviceError, match="'1'"):
        bench_devices(["1"])
    with pytest.raises(dk.InvalidValueError, match="quick='yes'"):
        dk.bench(quick="yes")  # type: ignore[arg-type]
