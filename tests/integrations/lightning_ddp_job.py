"""Run by test_ddp.py: Lightning's ddp strategy, 2 gloo ranks on the CPU, with DeviceKitCallback.

``python lightning_ddp_job.py OUT``; Lightning starts rank 1 by running the same command again.
Each rank writes ``OUT/rank<R>.json``: the leak warnings it issued, its leak reports, the batch
size it agreed on. Rank 1's training step fits 13 examples, rank 0's 21: both must train on 13.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import devicekit as dk
from devicekit.integrations.lightning import DeviceKitCallback


class Leaky(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)
        self.loss_history: list = []
        self.batch_size = 4

    def training_step(self, batch, batch_idx):
        x, y = batch
        if x.shape[0] > (21 if self.global_rank == 0 else 13):
            torch.empty(1 << 52, dtype=torch.uint8)  # out of (CPU) memory
        loss = F.mse_loss(self.layer(x), y)
        self.loss_history.append(loss)  # the leak, on every rank
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
        return DataLoader(data, batch_size=self.batch_size)


def main(out: Path) -> None:
    callback = DeviceKitCallback(leak_check_steps=4, oom_dir=out / "oom", batch_size_search={"start": 2, "maximum": 64})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback])
    module = Leaky()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(module)
    found = [str(w.message) for w in record if issubclass(w.category, dk.LeakWarning)]
    result = {"rank": trainer.global_rank, "warnings": found, "batch_size": module.batch_size,
              "reports": [[leak.holder for leak in r.leaks] for r in callback.leak_reports],
              "loader_batch_size": trainer.train_dataloader.batch_size}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
