"""The owner zoo (:mod:`tests.memory.leaks.owner_zoo`) inside a real Lightning Trainer and a real
HF Trainer, each with devicekit's callback: one function per framework returns its leak report.

Lightning: the case class is mixed into a LightningModule whose ``training_step`` calls
``self.grow(x, y)``. HF: the case class is mixed into a small model whose ``forward`` calls
``self.grow(x, labels)``, trained by a plain ``transformers.Trainer``. Both train 8 steps on the
CPU (leak check: a baseline step and 6 measured ones), on the batches the plain loops use.

Usage::

    report = lightning_report(OWNER_LEAKS["exception_chain"])
    report = hf_report(OWNER_LEAKS["exception_chain"], tmp_path)
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

import devicekit as dk
from devicekit.integrations.lightning import DeviceKitCallback as LightningCallback
from devicekit.integrations.transformers import DeviceKitCallback as HFCallback
from tests.memory.leaks.owner_zoo import BATCH, ROWS, Spec, batches, reset
from tests.memory.memory_truth import LiveStorages

STEPS = 8


class LitBase(L.LightningModule):
    """What every zoo LightningModule adds to its case: the training step, optimizer and data."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.grow(x, y)  # type: ignore[attr-defined]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        return batches()


class LiveAfterStep(L.Callback):
    """Live storage bytes after each training step (the truth sizes are checked against)."""

    def __init__(self, mode: LiveStorages) -> None:
        self.mode = mode
        self.live: list[int] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.live.append(self.mode.live)


def lightning_fit(spec: Spec, callback: L.Callback) -> None:
    module_class = type(f"Lit{spec.make.__name__}", (spec.make, LitBase), {})
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[callback])
    reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module_class())
    finally:
        reset()


def lightning_report(spec: Spec) -> dk.LeakReport:
    callback = LightningCallback(leak_check_steps=6, oom_dir=None)
    lightning_fit(spec, callback)
    (report,) = callback.leak_reports
    return report


def lightning_growth(spec: Spec) -> float:
    """Live storage bytes per step a Lightning run of ``spec`` keeps after warm-up (no devicekit)."""
    with LiveStorages() as mode:
        recorder = LiveAfterStep(mode)
        lightning_fit(spec, recorder)
    return per_step(recorder.live)


def per_step(live: list[int], warmup: int = 2) -> float:
    """Growth per step after ``warmup``, to the step before the last (the leak check's window:
    at the last step the data loader no longer holds the next batch)."""
    live = live[:-1]
    return (live[-1] - live[warmup]) / (len(live) - 1 - warmup)


class Rows(torch.utils.data.Dataset):
    """The plain loops' batches, one row at a time (the Trainer's collator stacks them again)."""

    def __init__(self) -> None:
        self.x, self.y = batches().dataset.tensors  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class HFBase(nn.Module):
    """What every zoo HF model adds to its case: a forward that returns the loss the Trainer wants."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.grow(x, labels)}  # type: ignore[attr-defined]


class HFLiveAfterStep(TrainerCallback):
    def __init__(self, mode: LiveStorages) -> None:
        self.mode = mode
        self.live: list[int] = []

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.live.append(self.mode.live)


def hf_train(spec: Spec, callback: TrainerCallback, output_dir: Path) -> None:
    model_class = type(f"HF{spec.make.__name__}", (spec.make, HFBase), {})
    args = TrainingArguments(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=BATCH,
                             learning_rate=0.01, optim="sgd", report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False,
                             logging_steps=100)
    reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Trainer(model=model_class(), args=args, train_dataset=Rows(), callbacks=[callback]).train()
    finally:
        reset()


def hf_report(spec: Spec, output_dir: Path) -> dk.LeakReport:
    callback = HFCallback(leak_check_steps=6, oom_dir=None)
    hf_train(spec, callback, output_dir)
    (report,) = callback.leak_reports
    return report


def hf_growth(spec: Spec, output_dir: Path) -> float:
    """Live storage bytes per step an HF run of ``spec`` keeps after warm-up (no devicekit)."""
    with LiveStorages() as mode:
        recorder = HFLiveAfterStep(mode)
        hf_train(spec, recorder, output_dir)
    return per_step(recorder.live)
