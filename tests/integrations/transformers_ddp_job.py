"""Run by test_ddp.py under torchrun: the HF Trainer with 2 gloo ranks on the CPU, DeviceKitCallback.

Each rank writes ``OUT/rank<R>.json``: its leak warnings, leak reports, the agreed batch size.
Rank 1's step fits 7 examples, rank 0's 11: both must train on 7.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import devicekit as dk
from devicekit.integrations.transformers import DeviceKitCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 96, (128, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class KeepingTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if inputs["input_ids"].shape[0] > (11 if self.args.process_index == 0 else 7):
            torch.empty(1 << 52, dtype=torch.uint8)  # out of (CPU) memory
        loss = super().compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        self.losses = getattr(self, "losses", [])
        self.losses.append(loss)  # the leak, on every rank
        return loss


def main(out: Path) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=str(out / "hf"), max_steps=6, per_device_train_batch_size=2,
                             logging_steps=2, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, ddp_backend="gloo")
    callback = DeviceKitCallback(leak_check_steps=4, oom_dir=out / "oom")
    trainer = KeepingTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])
    batch_size = callback.find_batch_size(trainer, start=2, maximum=64)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train()
    rank = int(os.environ["RANK"])
    found = [str(w.message) for w in record if issubclass(w.category, dk.LeakWarning)]
    result = {"rank": rank, "warnings": found, "batch_size": batch_size,
              "reports": [[leak.holder for leak in r.leaks] for r in callback.leak_reports],
              "world": args.world_size, "steps": trainer.state.global_step}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
