"""The framework callbacks on a real CUDA GPU: a real out-of-memory error in a Lightning step
leaves the bundle with torch's memory snapshot (memory_viz) and the plot; CUDA figures are logged."""

from __future__ import annotations

import csv
import json
import pickle
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_lightning_cuda_oom_bundle_has_the_snapshot(tmp_path: Path) -> None:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from devicekit.integrations.lightning import DeviceKitCallback

    class Greedy(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(64, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            if batch_idx == 3:  # more than the device has: the CUDA allocator fails
                total = torch.cuda.get_device_properties(0).total_memory
                torch.empty(2 * total, dtype=torch.uint8, device=self.device)
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = DataLoader(TensorDataset(torch.randn(512, 64), torch.randn(512, 1)), batch_size=32)
    callback = DeviceKitCallback(leak_check_steps=None, oom_dir=tmp_path / "oom", log_every=1)
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=8, logger=CSVLogger(tmp_path), log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback])
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit(Greedy(), data)
    folder = tmp_path / "oom" / "rank0"
    assert callback.bundles == [folder]
    assert "out of memory on cuda:0" in (folder / "report.txt").read_text()
    with open(folder / "snapshot.pickle", "rb") as handle:  # our own file, written by this test
        snapshot = pickle.load(handle)
    assert "segments" in snapshot and snapshot.get("device_traces")
    samples = json.loads((folder / "timeline.json").read_text())
    assert [s["step"] for s in samples] == [1, 2, 3] and all(s["allocated"] > 0 for s in samples)
    assert (folder / "memory.png").read_bytes()[:4] == b"\x89PNG"
    rows = list(csv.DictReader(open(Path(trainer.logger.log_dir) / "metrics.csv")))
    assert any(row.get("devicekit/allocated_mib") for row in rows)
    assert any(row.get("devicekit/peak_allocated_mib") for row in rows)
