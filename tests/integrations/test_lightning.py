"""The Lightning callback with the real Lightning Trainer, on the CPU, tiny models, random data."""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import devicekit as dk
from devicekit.integrations.lightning import DeviceKitCallback

HERE = Path(__file__).resolve()


def line_of(marker: str) -> int:
    return next(i for i, text in enumerate(HERE.read_text().splitlines(), 1) if marker in text and "line_of" not in text)


class Regression(L.LightningModule):
    """``keep``: "tensor" keeps each loss with its graph (the leak), "item" keeps floats."""

    def __init__(self, keep: str = "item", fail_at: int | None = None) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.keep = keep
        self.fail_at = fail_at
        self.loss_history: list = []
        self.batch_size = 8

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        if self.fail_at is not None and batch_idx == self.fail_at:
            torch.empty(1 << 52, dtype=torch.uint8)  # 4 PiB: the CPU allocator fails
        if self.keep == "tensor":
            self.loss_history.append(loss)  # LEAK-LINE
        else:
            self.loss_history.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(512, 16, generator=generator), torch.randn(512, 1, generator=generator))
        return DataLoader(data, batch_size=self.batch_size)


def fit(module: L.LightningModule, callback: DeviceKitCallback, tmp_path: Path, steps: int = 10) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=CSVLogger(tmp_path, name="logs"),
                        log_every_n_steps=2, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback])
    trainer.fit(module)
    return trainer


def leak_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, dk.LeakWarning)]


def test_a_module_that_keeps_its_losses_is_reported_by_name_line_and_fix(tmp_path: Path) -> None:
    callback = DeviceKitCallback(leak_check_steps=6, oom_dir=tmp_path / "oom")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(Regression(keep="tensor"), callback, tmp_path)
    found = leak_warnings(record)
    assert len(found) == 1, found
    assert "self.loss_history" in found[0] and f"{HERE}:{line_of('LEAK-LINE')}" in found[0]
    (report,) = callback.leak_reports
    (leak,) = report.leaks
    assert leak.holder == "self.loss_history"
    assert leak.lineno == line_of("LEAK-LINE") and leak.filename == str(HERE)
    assert leak.kind in dk.memory.leaks.KINDS and leak.fix and leak.fix in found[0]  # the finder's own words


def test_a_module_that_keeps_floats_is_not_reported(tmp_path: Path) -> None:
    callback = DeviceKitCallback(leak_check_steps=6, oom_dir=tmp_path / "oom")
    module = Regression(keep="item")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(module, callback, tmp_path)
    assert leak_warnings(record) == []
    (report,) = callback.leak_reports
    assert report.ok and report.steps >= 6
    assert len(module.loss_history) == 10  # it ran, and its list did grow


def test_memory_figures_reach_lightnings_logger(tmp_path: Path) -> None:
    trainer = fit(Regression(), DeviceKitCallback(leak_check_steps=None), tmp_path)
    rows = list(csv.DictReader(open(Path(trainer.logger.log_dir) / "metrics.csv")))
    logged = [row for row in rows if row.get("devicekit/rss_mib")]
    assert len(logged) == 5  # every log_every_n_steps=2 of 10 steps
    assert [int(row["step"]) for row in logged] == [1, 3, 5, 7, 9]
    for row in logged:
        assert 10 < float(row["devicekit/rss_mib"]) <= float(row["devicekit/peak_rss_mib"])
    assert "devicekit/leaks" not in rows[0]


def test_leak_checks_again_every_m_steps(tmp_path: Path) -> None:
    callback = DeviceKitCallback(leak_check_steps=4, leak_check_every=10)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(Regression(keep="tensor"), callback, tmp_path, steps=16)
    assert len(callback.leak_reports) == 2  # steps 1-5 and 11-15
    assert len(leak_warnings(record)) == 2
    assert all(r.leaks[0].holder == "self.loss_history" for r in callback.leak_reports)


def test_an_out_of_memory_error_leaves_a_bundle_then_goes_on(tmp_path: Path) -> None:
    callback = DeviceKitCallback(leak_check_steps=None, oom_dir=tmp_path / "oom", log_every=1)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        fit(Regression(fail_at=3), callback, tmp_path)
    folder = tmp_path / "oom" / "rank0"
    assert callback.bundles == [folder]
    text = (folder / "report.txt").read_text()
    assert "out of memory on cpu" in text and "asked for:    4096 TiB" in text and "rank 0, step 4" in text
    data = json.loads((folder / "report.json").read_text())
    assert data["rank"] == 0 and data["step"] == 4 and data["diagnosis"]["requested"] == 1 << 52
    assert [s["step"] for s in json.loads((folder / "timeline.json").read_text())] == [1, 2, 3]
    assert (folder / "memory.png").read_bytes()[:4] == b"\x89PNG"
    assert not (folder / "snapshot.pickle").exists()  # CUDA only


def test_other_errors_leave_no_bundle(tmp_path: Path) -> None:
    class Broken(Regression):
        def training_step(self, batch, batch_idx):
            raise ValueError("not memory")

    callback = DeviceKitCallback(oom_dir=tmp_path / "oom")
    with pytest.raises(ValueError, match="not memory"):
        fit(Broken(), callback, tmp_path)
    assert callback.bundles == [] and not (tmp_path / "oom").exists()


class Capped(Regression):
    """Batches above ``limit`` fail as the CPU allocator does when memory runs out."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def training_step(self, batch, batch_idx):
        if batch[0].shape[0] > self.limit:
            torch.empty(1 << 52, dtype=torch.uint8)
        self.log("train_loss", 1.0)  # a trial runs outside a Trainer step: logging is skipped
        return super().training_step(batch, batch_idx)


def test_find_batch_size_is_exact_and_left_on_the_module(tmp_path: Path) -> None:
    module = Capped(limit=37)
    callback = DeviceKitCallback()
    assert callback.find_batch_size(module, start=4, maximum=256) == 37
    assert module.batch_size == 37 and callback.batch_size == 37
    assert all(p.grad is None for p in module.parameters())


def test_batch_size_search_runs_when_fitting_starts(tmp_path: Path) -> None:
    module = Capped(limit=21)
    callback = DeviceKitCallback(leak_check_steps=None, batch_size_search={"start": 2, "maximum": 64})
    trainer = fit(module, callback, tmp_path, steps=2)
    assert module.batch_size == 21
    assert trainer.train_dataloader.batch_size == 21


@pytest.mark.parametrize(("options", "named"), [
    ({"leak_check_steps": 2}, "leak_check_steps=2"),
    ({"leak_check_steps": 6, "leak_check_every": 6}, "leak_check_every=6"),
    ({"log_every": 0}, "log_every=0"),
    ({"oom_dir": 3}, "oom_dir=3"),
    ({"batch_size_search": {"begin": 3}}, "batch_size_search="),
])
def test_bad_options_are_one_line_errors(options: dict, named: str) -> None:
    with pytest.raises(dk.InvalidValueError, match=named):
        DeviceKitCallback(**options)


def test_the_older_pytorch_lightning_package_drives_the_same_callback(tmp_path: Path) -> None:
    import pytorch_lightning as pl

    class OldStyle(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(16, 1)
            self.loss_history: list = []

        def training_step(self, batch, batch_idx):
            loss = F.mse_loss(self.layer(batch[0]), batch[1])
            self.loss_history.append(loss)  # OLD-LEAK-LINE
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = DataLoader(TensorDataset(torch.randn(160, 16), torch.randn(160, 1)), batch_size=16)
    callback = DeviceKitCallback(leak_check_steps=6)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=pl.loggers.CSVLogger(tmp_path),
                         log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        trainer.fit(OldStyle(), data)
    (leak,) = callback.leak_reports[0].leaks
    assert leak.holder == "self.loss_history" and leak.lineno == line_of("OLD-LEAK-LINE")
    rows = list(csv.DictReader(open(Path(trainer.logger.log_dir) / "metrics.csv")))
    assert sum(1 for row in rows if row.get("devicekit/rss_mib")) == 8
