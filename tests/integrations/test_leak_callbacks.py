"""The leak finder inside Lightning and the HF Trainer (issue 36): the callbacks search from the
memory too, so a leak only the memory shows (a hook registered in every ``training_step``, an
exception chain) is named there as ``dk.find_leaks`` names it in a plain loop over the same
step; a loss log emptied every epoch is slow growth, and clean modules report nothing at all."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import devicekit as dk
from devicekit.integrations.lightning import DeviceKitCallback as LightningCallback
from devicekit.integrations.transformers import DeviceKitCallback as HFCallback

HERE = Path(__file__).resolve()


def line_of(marker: str) -> int:
    return next(i for i, text in enumerate(HERE.read_text().splitlines(), 1) if text.rstrip().endswith(marker))


def verdict(report: dk.LeakReport) -> list[tuple[str, str, int, str]]:
    """What must agree between entry points: the holder below its root name, kind, line, severity."""
    return [(leak.holder.split(".", 1)[-1], leak.kind, leak.lineno, leak.severity)
            for leak in [*report.leaks, *report.minor]]


class Module(L.LightningModule):
    """``mode``: "clean", "hook" (a forward hook every step), "chain" (an exception chain) or
    "log" (detached mse losses, emptied every epoch as Lightning's docs do it)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.mode = mode
        self.training_step_outputs: list[torch.Tensor] = []
        self.last_error: BaseException | None = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.mode == "hook":
            feats: list[torch.Tensor] = []
            self.layer[1].register_forward_hook(lambda m, i, o: feats.append(o))  # GROW-L-hook
        loss = F.mse_loss(self.layer(x), y)
        if self.mode == "chain":
            try:
                raise ValueError(f"bad batch {batch_idx}")
            except ValueError as e:
                e.__cause__ = self.last_error
                self.last_error = e  # GROW-L-chain
        if self.mode == "log":
            self.training_step_outputs.append(loss.detach())  # GROW-L-log
        return loss

    def on_train_epoch_end(self) -> None:
        self.training_step_outputs.clear()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(256, 16, generator=generator), torch.randn(256, 1, generator=generator))
        return DataLoader(data, batch_size=8)


def lightning_report(mode: str) -> dk.LeakReport:
    callback = LightningCallback(leak_check_steps=6, oom_dir=None)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=8, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Module(mode))
    (report,) = callback.leak_reports
    return report


def plain_report(mode: str) -> dk.LeakReport:
    """The same training step in a plain loop, through dk.find_leaks."""
    module = Module(mode)
    opt = module.configure_optimizers()
    batches = iter(module.train_dataloader())

    def step() -> None:
        loss = module.training_step(next(batches), 0)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return dk.find_leaks(step)


@pytest.mark.parametrize(("mode", "kind", "severity"), [
    ("hook", "hook_per_step", "leak"), ("chain", "exception_frames", "leak"), ("log", "module_cache", "minor")])
def test_lightning_names_what_find_leaks_names_in_a_plain_loop(mode: str, kind: str, severity: str) -> None:
    report, plain = lightning_report(mode), plain_report(mode)
    assert verdict(report) == verdict(plain), f"{report}\n---\n{plain}"
    ((holder, found_kind, lineno, found_severity),) = verdict(report)
    assert (found_kind, lineno, found_severity) == (kind, line_of(f"# GROW-L-{mode}"), severity), str(report)
    assert report.ok is (severity == "minor") and not report.notes, str(report)
    if mode == "log":  # the 0-d loss keeps its 8x1 buffer; emptied each epoch, so not unbounded
        (slow,) = report.minor
        assert "clone()" in slow.fix and "until emptied" in slow.projection, str(report)
        assert slow.cleared_at.endswith("(on_train_epoch_end)"), slow.cleared_at


def test_a_clean_lightning_module_reports_nothing_not_even_a_note() -> None:
    report = lightning_report("clean")
    assert report.ok and not report.minor and not report.notes, str(report)


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 96, (64, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class HookTrainer(Trainer):
    """``mode``: "clean", "hook" (a forward hook every step) or "chain" (an exception chain)."""

    def __init__(self, *args, mode: str = "clean", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mode = mode
        self.last_error: BaseException | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.mode == "hook":
            feats: list[torch.Tensor] = []
            model.transformer.h[0].mlp.register_forward_hook(lambda m, i, o: feats.append(o))  # GROW-HF-hook
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)
        if self.mode == "chain":
            try:
                raise ValueError("bad batch")
            except ValueError as e:
                e.__cause__ = self.last_error
                self.last_error = e  # GROW-HF-chain
        return loss


@pytest.mark.parametrize(("mode", "kind"), [("clean", None), ("hook", "hook_per_step"), ("chain", "exception_frames")])
def test_the_hf_trainer_finds_leaks_only_the_memory_shows(tmp_path: Path, mode: str, kind: str | None) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    callback = HFCallback(leak_check_steps=6, oom_dir=None)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4, logging_steps=4,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                             dataloader_num_workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        HookTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback], mode=mode).train()
    (report,) = callback.leak_reports
    assert not report.notes and not report.minor, str(report)
    if kind is None:
        assert report.ok, str(report)
        return
    (leak,) = report.leaks
    assert (leak.kind, leak.lineno) == (kind, line_of(f"# GROW-HF-{mode}")), str(report)
    assert leak.holder == ("model.transformer.h.0.mlp._forward_hooks" if mode == "hook" else "self.last_error")


class Failing(Tokens):
    """Its fourth batch cannot be built: train() ends without on_train_end."""

    def __init__(self) -> None:
        super().__init__()
        self.served = 0

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.served += 1
        if self.served > 12:
            raise ValueError("corrupt example")
        return super().__getitem__(i)


def test_a_failing_batch_inside_the_leak_window_gives_the_garbage_collector_back(tmp_path: Path) -> None:
    import gc

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    callback = HFCallback(leak_check_steps=6, oom_dir=None)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    frozen = gc.get_freeze_count()
    with warnings.catch_warnings(), pytest.raises(ValueError, match="corrupt example"):
        warnings.simplefilter("ignore")
        HookTrainer(model=model, args=args, train_dataset=Failing(), callbacks=[callback]).train()
    assert callback.monitor.step >= 2  # it failed inside the window
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    assert callback.leak_reports == []  # the window was dropped, not judged
