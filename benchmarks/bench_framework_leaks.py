"""The leak check's cost per training step inside Lightning and the HF Trainer (issue 36).

Each workload runs bare and with ``DeviceKitCallback(leak_check_steps=STEPS)`` (so every timed
step is inside the leak-check window: the detector started, the memory searched, lines traced
where something grew), on a clean model and on two leaking ones: a module that keeps its loss
tensors (``self.history.append(loss)``) and one that registers a forward hook in every step.
Each leaking variant is compared with the same leaking workload without the callback, in the
same run (the leak itself makes the step slower). Variants take turns round after round
(``timing.interleaved``); the figure is the median CPU milliseconds per step (process time, one
torch thread), the first steps of each run left out.

Lightning: an MLP (256-512-512-10, batch 64, Adam). Hugging Face: a GPT-2 built from GPT2Config
(2 layers, 64 wide, tied embeddings), 32 tokens, batch 8, AdamW.

Run: python benchmarks/bench_framework_leaks.py [--rounds N] [--only lightning|hf]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's devicekit
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from bench_callbacks import median_step_ms  # noqa: E402  (the same per-step clock)
from timing import interleaved  # noqa: E402

STEPS = 30
MODES = ("clean", "keeps its losses", "hook every step")
warnings.simplefilter("ignore")
logging.disable(logging.WARNING)


def lightning_variants(out: Path, rounds: int) -> tuple[dict[str, list[float]], dict[str, str]]:
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from devicekit.integrations.lightning import DeviceKitCallback

    class MLP(L.LightningModule):
        def __init__(self, mode: str) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
            self.mode = mode
            self.history: list = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.mode == "hook every step":
                feats: list = []
                self.net[1].register_forward_hook(lambda m, i, o: feats.append(o))
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.history.append(loss if self.mode == "keeps its losses" else loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    data = TensorDataset(torch.randn(64 * STEPS, 256), torch.randint(0, 10, (64 * STEPS,)))

    class Stamps(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_end(self, *args) -> None:
            self.times.append(time.process_time())

    results: dict[str, list[float]] = {}
    reports: dict[str, str] = {}

    def variant(name: str, mode: str, check: bool):
        def run() -> None:
            stamps = Stamps()
            callbacks = [DeviceKitCallback(leak_check_steps=STEPS, oom_dir=None)] if check else []
            trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[*callbacks, stamps])
            torch.manual_seed(0)
            trainer.fit(MLP(mode), DataLoader(data, batch_size=64))
            results.setdefault(name, []).append(median_step_ms(stamps.times))
            if check:
                reports[name] = str(callbacks[0].leak_reports[0])
        return run

    methods = {}
    for mode in MODES:
        methods[f"{mode}: bare Trainer"] = variant(f"{mode}: bare Trainer", mode, False)
        methods[f"{mode}: DeviceKitCallback, checking"] = variant(f"{mode}: DeviceKitCallback, checking", mode, True)
    interleaved(methods, rounds=rounds, warmup=1)
    return results, reports


def transformers_variants(out: Path, rounds: int) -> tuple[dict[str, list[float]], dict[str, str]]:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        PrinterCallback,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from devicekit.integrations.transformers import DeviceKitCallback

    ids = torch.randint(0, 256, (8 * STEPS, 32), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row} for row in ids]

    class Keeping(Trainer):
        mode = "clean"

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if self.mode == "hook every step":
                feats: list = []
                model.transformer.h[0].mlp.register_forward_hook(lambda m, i, o: feats.append(o))
            loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            self.history = getattr(self, "history", [])
            self.history.append(loss if self.mode == "keeps its losses" else loss.item())
            return loss

    class Stamps(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_end(self, *args, **kwargs) -> None:
            self.times.append(time.process_time())

    results: dict[str, list[float]] = {}
    reports: dict[str, str] = {}

    def variant(name: str, mode: str, check: bool):
        def run() -> None:
            torch.manual_seed(0)
            model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2))
            args = TrainingArguments(output_dir=str(out / "hf"), max_steps=STEPS, per_device_train_batch_size=8,
                                     logging_steps=10, report_to=[], save_strategy="no", use_cpu=True,
                                     disable_tqdm=True, dataloader_num_workers=0)
            stamps = Stamps()
            callbacks = [DeviceKitCallback(leak_check_steps=STEPS, oom_dir=None)] if check else []
            trainer = Keeping(model=model, args=args, train_dataset=dataset, callbacks=[*callbacks, stamps])
            trainer.remove_callback(PrinterCallback)
            trainer.mode = mode
            trainer.train()
            results.setdefault(name, []).append(median_step_ms(stamps.times))
            if check:
                reports[name] = str(callbacks[0].leak_reports[0])
        return run

    methods = {}
    for mode in MODES:
        methods[f"{mode}: bare Trainer"] = variant(f"{mode}: bare Trainer", mode, False)
        methods[f"{mode}: DeviceKitCallback, checking"] = variant(f"{mode}: DeviceKitCallback, checking", mode, True)
    interleaved(methods, rounds=rounds, warmup=1)
    return results, reports


def table(title: str, results: dict[str, list[float]], rounds: int) -> None:
    print(f"\n{title}: median CPU ms per step over {rounds} interleaved rounds of {STEPS} steps")
    print("| workload | bare ms/step | checking ms/step | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for mode in MODES:
        bare = statistics.median(results[f"{mode}: bare Trainer"])
        checked = statistics.median(results[f"{mode}: DeviceKitCallback, checking"])
        print(f"| {mode} | {bare:.2f} | {checked:.2f} | {checked / bare:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=("lightning", "hf"))
    parser.add_argument("--reports", action="store_true", help="print the leak reports too")
    options = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"Python {platform.python_version()}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, variants in (("lightning", lightning_variants), ("hf", transformers_variants)):
            if options.only not in (None, name):
                continue
            results, reports = variants(Path(tmp) / name, options.rounds)
            table("Lightning" if name == "lightning" else "Hugging Face Trainer", results, options.rounds)
            if options.reports:
                print("\n".join(f"{name}: {report}" for name, report in reports.items()))


if __name__ == "__main__":
    main()
