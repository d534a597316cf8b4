"""DeviceKitCallback overhead per training step, against the bare Trainer and Lightning's own monitor.

Lightning: an MLP (256-512-512-10, batch 64, Adam) on the CPU; the Hugging Face Trainer: a tiny
GPT-2 (2 layers, 64 wide, tied embeddings, 32 tokens, batch 8). Each variant fits the same steps
in one process, variants taking turns round after round (``timing.interleaved``), and the table
shows the median CPU milliseconds per step (process time, one torch thread: other jobs on a
shared machine do not count) and the ratio to the bare Trainer measured in the same run:

- the bare Trainer a second time: the spread of the measurement itself on a loaded machine
- ``DeviceStatsMonitor(cpu_stats=True)``: Lightning's own per-step device statistics (psutil)
- ``DeviceKitCallback(leak_check_steps=None)``: memory logged at the logging interval, OOM bundle armed
- ``DeviceKitCallback`` during its leak-check steps, on a clean model, and on one that keeps its
  loss tensors (the line tracer then runs on every step)

Run: python benchmarks/bench_callbacks.py  (a few minutes on a 2-core CPU; ``--hooks-only``:
just the callbacks' own cost per step, timed directly, in seconds)
"""

from __future__ import annotations

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
from timing import interleaved  # noqa: E402

STEPS = 40
SKIP = 3  # first steps: warm-up (allocations, optimizer state)
ROUNDS = 7
warnings.simplefilter("ignore")
logging.disable(logging.WARNING)


def median_step_ms(stamps: list[float]) -> float:
    gaps = [b - a for a, b in zip(stamps[SKIP:], stamps[SKIP + 1:], strict=False)]
    return statistics.median(gaps) * 1e3


# -- Lightning -------------------------------------------------------------------------------------
def lightning_variants(out: Path) -> dict[str, object]:
    import lightning as L
    from lightning.pytorch.callbacks import DeviceStatsMonitor
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from devicekit.integrations.lightning import DeviceKitCallback

    class MLP(L.LightningModule):
        def __init__(self, keep: bool) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
            self.keep = keep
            self.history: list = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.history.append(loss if self.keep else loss.item())
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

    def variant(name: str, make, keep: bool = False):
        def run() -> None:
            stamps = Stamps()
            trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=L.pytorch.loggers.CSVLogger(out),
                                log_every_n_steps=10, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[*make(), stamps])
            torch.manual_seed(0)
            trainer.fit(MLP(keep), DataLoader(data, batch_size=64))
            results.setdefault(name, []).append(median_step_ms(stamps.times))
        return run

    methods = {
        "bare Trainer": variant("bare Trainer", list),
        "bare Trainer again (noise floor)": variant("bare Trainer again (noise floor)", list),
        "DeviceStatsMonitor": variant("DeviceStatsMonitor", lambda: [DeviceStatsMonitor(cpu_stats=True)]),
        "DeviceKitCallback, leak checks off": variant("DeviceKitCallback, leak checks off",
                                                      lambda: [DeviceKitCallback(leak_check_steps=None, oom_dir=out)]),
        "DeviceKitCallback, leak-check steps": variant("DeviceKitCallback, leak-check steps",
                                                       lambda: [DeviceKitCallback(leak_check_steps=STEPS, oom_dir=out)]),
        "same, model keeps its losses": variant("same, model keeps its losses",
                                                lambda: [DeviceKitCallback(leak_check_steps=STEPS, oom_dir=out)], keep=True),
    }
    interleaved(methods, rounds=ROUNDS, warmup=1)
    return results


# -- Hugging Face Trainer --------------------------------------------------------------------------
def transformers_variants(out: Path) -> dict[str, object]:
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
        keep = False

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            self.history = getattr(self, "history", [])
            self.history.append(loss if self.keep else loss.item())
            return loss

    class Stamps(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_end(self, *args, **kwargs) -> None:
            self.times.append(time.process_time())

    results: dict[str, list[float]] = {}

    def variant(name: str, make, keep: bool = False):
        def run() -> None:
            torch.manual_seed(0)
            model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2))
            args = TrainingArguments(output_dir=str(out / "hf"), max_steps=STEPS, per_device_train_batch_size=8,
                                     logging_steps=10, report_to=[], save_strategy="no", use_cpu=True,
                                     disable_tqdm=True, dataloader_num_workers=0)
            stamps = Stamps()
            trainer = Keeping(model=model, args=args, train_dataset=dataset, callbacks=[*make(), stamps])
            trainer.remove_callback(PrinterCallback)  # no log lines on stdout between the tables
            trainer.keep = keep
            trainer.train()
            results.setdefault(name, []).append(median_step_ms(stamps.times))
        return run

    methods = {
        "bare Trainer": variant("bare Trainer", list),
        "bare Trainer again (noise floor)": variant("bare Trainer again (noise floor)", list),
        "DeviceKitCallback, leak checks off": variant("DeviceKitCallback, leak checks off",
                                                      lambda: [DeviceKitCallback(leak_check_steps=None, oom_dir=out)]),
        "DeviceKitCallback, leak-check steps": variant("DeviceKitCallback, leak-check steps",
                                                       lambda: [DeviceKitCallback(leak_check_steps=STEPS, oom_dir=out)]),
        "same, compute_loss keeps its losses": variant("same, compute_loss keeps its losses",
                                                       lambda: [DeviceKitCallback(leak_check_steps=STEPS, oom_dir=out)],
                                                       keep=True),
    }
    interleaved(methods, rounds=ROUNDS, warmup=1)
    return results


def hook_costs() -> None:
    """The callbacks' own cost, timed directly: per-step timings above are noisier than it."""
    from devicekit.integrations.monitor import TrainingMonitor

    monitor = TrainingMonitor(leak_check_steps=None, oom_dir=None)
    monitor.begin(rank=0, device="cpu")
    module = torch.nn.Linear(2, 2)
    n = 20_000
    began = time.process_time()
    for step in range(1, n + 1):
        monitor.after_step(step, {"self": module}, log=False)
    idle = (time.process_time() - began) / n * 1e6
    began = time.process_time()
    for step in range(1, 2001):
        monitor.after_step(step, {"self": module}, log=True)
    logged = (time.process_time() - began) / 2000 * 1e6
    print(f"\nper step, timed directly: {idle:.2f} us on a step that is not logged, {logged:.1f} us on a logged "
          f"step (reading the figures; the framework's own log call comes on top)")


def table(title: str, results: dict[str, list[float]]) -> None:
    base = statistics.median(results["bare Trainer"])
    print(f"\n{title}: median CPU ms per step over {ROUNDS} interleaved rounds of {STEPS} steps")
    print("| variant | ms/step | vs bare Trainer |")
    print("| --- | ---: | ---: |")
    for name, values in results.items():
        ms = statistics.median(values)
        print(f"| {name} | {ms:.2f} | {ms / base:.3f}x |")


def main() -> None:
    torch.set_num_threads(1)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    hook_costs()
    if "--hooks-only" in sys.argv:
        return
    with tempfile.TemporaryDirectory() as tmp:
        table("Lightning", lightning_variants(Path(tmp) / "lightning"))
        table("Hugging Face Trainer", transformers_variants(Path(tmp) / "hf"))


if __name__ == "__main__":
    main()
