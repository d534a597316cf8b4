"""The Hugging Face callback with the real Trainer: a tiny GPT-2 (tied embeddings) built from
GPT2Config, random tokens, the CPU, nothing downloaded."""

from __future__ import annotations

import ast
import json
import warnings
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import devicekit as dk
from devicekit.integrations.transformers import DeviceKitCallback

HERE = Path(__file__).resolve()


def line_of(marker: str) -> int:
    return next(i for i, text in enumerate(HERE.read_text().splitlines(), 1) if marker in text and "line_of" not in text)


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    return model


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 256, length: int = 16) -> None:
        self.ids = torch.randint(0, 96, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class KeepingTrainer(Trainer):
    """``keep``: "tensor" keeps each loss with its graph (the leak), "item" keeps floats;
    ``fail_at``: the step whose loss computation runs out of (CPU) memory."""

    def __init__(self, *args, keep: str = "item", fail_at: int | None = None, limit: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.keep, self.fail_at, self.limit = keep, fail_at, limit
        self.losses: list = []
        self.sizes: list[int] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.sizes.append(inputs["input_ids"].shape[0])
        too_big = self.limit is not None and inputs["input_ids"].shape[0] > self.limit
        if too_big or (self.fail_at is not None and self.state.global_step + 1 == self.fail_at):
            torch.empty(1 << 52, dtype=torch.uint8)  # 4 PiB: the CPU allocator fails
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)
        if self.keep == "tensor":
            self.losses.append(loss)  # LEAK-LINE
        else:
            self.losses.append(loss.item())
        return loss


def trainer_for(tmp_path: Path, callback: DeviceKitCallback, steps: int = 10, **options) -> KeepingTrainer:
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4,
                             logging_steps=2, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, learning_rate=1e-3)
    return KeepingTrainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(), callbacks=[callback], **options)


def leak_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, dk.LeakWarning)]


def test_a_compute_loss_that_keeps_losses_is_reported_by_name_line_and_fix(tmp_path: Path) -> None:
    callback = DeviceKitCallback(leak_check_steps=6, oom_dir=tmp_path / "oom")
    trainer = trainer_for(tmp_path, callback, keep="tensor")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    found = leak_warnings(record)
    assert len(found) == 1, found
    assert "self.losses" in found[0] and f"{HERE}:{line_of('LEAK-LINE')}" in found[0]
    (report,) = callback.leak_reports
    (leak,) = report.leaks
    assert leak.holder == "self.losses" and leak.lineno == line_of("LEAK-LINE")
    assert leak.kind in dk.memory.leaks.KINDS and leak.fix and leak.fix in found[0]  # the finder's own words
    assert any(entry.get("devicekit/leaks") == 1.0 for entry in trainer.state.log_history)


def test_a_compute_loss_that_keeps_floats_is_not_reported(tmp_path: Path) -> None:
    callback = DeviceKitCallback(leak_check_steps=6)
    trainer = trainer_for(tmp_path, callback, keep="item")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    assert leak_warnings(record) == []
    (report,) = callback.leak_reports
    assert report.ok and report.steps >= 6 and len(trainer.losses) == 10


def test_memory_figures_reach_the_trainers_log(tmp_path: Path) -> None:
    trainer = trainer_for(tmp_path, DeviceKitCallback(leak_check_steps=None))
    trainer.train()
    logged = [e for e in trainer.state.log_history if "devicekit/rss_mib" in e]
    assert [e["step"] for e in logged] == [2, 4, 6, 8, 10]  # every logging_steps=2
    for entry in logged:
        assert 10 < entry["devicekit/rss_mib"] <= entry["devicekit/peak_rss_mib"]


def test_an_out_of_memory_error_leaves_a_bundle_then_goes_on(tmp_path: Path) -> None:
    callback = DeviceKitCallback(leak_check_steps=None, oom_dir=tmp_path / "oom", log_every=1)
    trainer = trainer_for(tmp_path, callback, fail_at=4)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        trainer.train()
    folder = tmp_path / "oom" / "rank0"
    assert callback.bundles == [folder]
    text = (folder / "report.txt").read_text()
    assert "out of memory on cpu" in text and "asked for:    4096 TiB" in text and "rank 0, step 4" in text
    assert [s["step"] for s in json.loads((folder / "timeline.json").read_text())] == [1, 2, 3]
    assert (folder / "memory.png").read_bytes()[:4] == b"\x89PNG"
    assert "training_step" not in vars(trainer)  # the error ended train(): unwrapped
    trainer.fail_at = None
    trainer.train()  # again, now without the failure: wrapped once more, no new bundle
    assert callback.bundles == [folder] and len(trainer.losses) == 10 + 3
    assert "training_step" not in vars(trainer)


def test_find_batch_size_is_exact_and_set_on_the_trainer(tmp_path: Path) -> None:
    callback = DeviceKitCallback(leak_check_steps=None)
    trainer = trainer_for(tmp_path, callback, steps=2, limit=11)
    assert callback.find_batch_size(trainer, start=2, maximum=64) == 11
    assert trainer.args.per_device_train_batch_size == 11
    assert all(p.grad is None for p in trainer.model.parameters())
    trainer.sizes.clear()
    trainer.train()
    assert trainer.sizes == [11, 11]  # the Trainer's own batches are the size found


def test_auto_find_batch_size_retries_each_leave_a_bundle(tmp_path: Path) -> None:
    callback = DeviceKitCallback(leak_check_steps=None, oom_dir=tmp_path / "oom")
    trainer = trainer_for(tmp_path, callback, steps=2, limit=11)
    trainer.args.auto_find_batch_size = True
    trainer.args.per_device_train_batch_size = 16
    trainer._train_batch_size = 16
    trainer.train()
    assert trainer.sizes[-1] <= 11 and len(trainer.losses) == 2  # HF's own search found a size that fits
    failed = len({size for size in trainer.sizes if size > 11})
    assert [b.name for b in callback.bundles] == ["rank0"] + [f"rank0-{n}" for n in range(2, failed + 1)]
    assert "training_step" not in vars(trainer)


def run_python(code: str) -> str:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], check=True, timeout=180, capture_output=True,
                          text=True).stdout


FRAMEWORKS = ("torch", "transformers", "lightning", "pytorch_lightning")


@pytest.mark.slow
def test_import_pulls_in_no_other_framework() -> None:
    # one process, in this order: devicekit alone; the HF module; then Lightning's own import,
    # and what devicekit's Lightning module adds to it (Lightning pulls in parts of transformers
    # through torchmetrics when transformers is installed: that is Lightning's doing, not ours)
    code = ("import sys\n"
            "def tops(): return {m.split('.')[0] for m in sys.modules}\n"
            "import devicekit, devicekit.integrations\n"
            f"print(sorted(tops() & set({FRAMEWORKS!r})))\n"
            "import devicekit.integrations.transformers\n"
            f"print(sorted(tops() & set({FRAMEWORKS!r})))\n"
            "import lightning.pytorch\n"
            "before = set(sys.modules)\n"
            "import devicekit.integrations.lightning\n"
            "print(sorted({m.split('.')[0] for m in set(sys.modules) - before}))\n")
    plain, hf, added = run_python(code).splitlines()
    assert plain == "[]" and hf == "['torch', 'transformers']"
    assert set(ast.literal_eval(added)) <= {"devicekit", "psutil", "rich", "click", "numpy", "pynvml",
                                            "markdown_it", "mdurl", "pygments"}, added
