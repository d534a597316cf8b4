"""A Hugging Face decoder trained over two devices: dk.Pipeline vs naive dk.split vs accelerate's dispatch_model.

Run: ``.venv/bin/python benchmarks/bench_hf_pipeline.py`` (a few minutes on 2 shared cores).

The model: a Llama-style decoder from a config (hidden 256, 8 layers, 8 heads, vocabulary 2000,
tied embeddings; random weights), a batch of 16 sequences of 128 tokens with labels. A step is
``out = model(**batch); out.loss.backward()``, gradients cleared after. Compared:

* ``accelerate``: ``dispatch_model`` with a device map that puts the first half of the layers on
  the first device and the rest on the second (on CPU: every entry ``"cpu"`` and
  ``force_hooks=True``, so accelerate's per-module hooks run as they do across GPUs);
* ``split``: ``dk.split(model, devices, sample=batch)``: the same cut made by devicekit's
  balancer, one device busy at a time;
* ``pipeline``: ``dk.Pipeline(model, devices, chunks=4, sample=batch)``: four micro-batches
  overlapped between the two stages (default recompute: ``checkpoint="except_last"``), and
  ``pipeline-norecompute`` the same with ``checkpoint="never"``.

Step time (and, apart, the forward alone without grad, where the stages overlap on CPU: torch's
autograd engine runs a CPU backward in the calling thread): best and median of interleaved rounds in one process (methods take turns, so other
processes' load hits all alike), torch limited to one intra-op thread so each CPU "device" owns
one core. Peak memory: each method in its own process; on CPU the bytes malloc has handed out
(glibc's ``mallinfo2``, every thread's arena), sampled every millisecond during 3 steps, above
what they were before them (one CPU holds both "devices"); on GPUs
``torch.cuda.max_memory_allocated`` per device. Ratios are against
accelerate, the anchor an HF user would otherwise pick.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

import torch
from timing import interleaved  # benchmarks/timing.py

import devicekit as dk

METHODS = ("accelerate", "split", "pipeline", "pipeline-norecompute")


def build() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 2000, (16, 128), generator=g)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def devices() -> list[str]:
    return ["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cpu", "cpu"]


def prepare(method: str, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    where = devices()
    if method.startswith("pipeline"):
        recompute = "never" if method.endswith("norecompute") else "except_last"
        return dk.Pipeline(model, where, chunks=4, sample=batch, checkpoint=recompute)
    if method == "split":
        return dk.split(model, where, sample=batch)
    from accelerate import dispatch_model

    half = model.config.num_hidden_layers // 2
    device_map = {"model.embed_tokens": where[0], "model.rotary_emb": where[0], "lm_head": where[0],
                  "model.norm": where[1]}
    device_map.update({f"model.layers.{i}": where[0] if i < half else where[1]
                       for i in range(model.config.num_hidden_layers)})
    return dispatch_model(model, device_map=device_map, main_device=where[0], force_hooks=True)


def step(runner: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    out = runner(**batch, use_cache=False)
    out.loss.backward()
    for p in model.parameters():
        p.grad = None
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _heap_in_use() -> Any:
    """Bytes malloc has handed out and not taken back, over all threads' arenas (glibc's mallinfo2;
    torch's CPU tensors come from malloc); the process's resident memory where that is missing."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                  "keepcost")

        class Mallinfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in fields]

        libc.mallinfo2.restype = Mallinfo2
        return lambda: (lambda m: m.uordblks + m.hblkhd)(libc.mallinfo2())
    except (OSError, AttributeError):
        import psutil

        proc = psutil.Process()
        return lambda: proc.memory_info().rss


def forward(runner: Any, batch: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        runner(**batch, use_cache=False)


def peak_memory(method: str) -> dict[str, int]:
    """Run in a fresh process: bytes above the start, peak during 3 steps (per CUDA device, or the process)."""
    torch.set_num_threads(1)
    model, batch = build()
    runner = prepare(method, model, batch)
    step(runner, model, batch)  # first call: lazy set-up, counted node numbers
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        for d in range(2):
            torch.cuda.reset_peak_memory_stats(d)
        start = {d: torch.cuda.memory_allocated(d) for d in range(2)}
        for _ in range(3):
            step(runner, model, batch)
        return {f"cuda:{d}": torch.cuda.max_memory_allocated(d) - start[d] for d in range(2)}
    in_use = _heap_in_use()
    base, peak, done = in_use(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], in_use())
            time.sleep(0.001)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    for _ in range(3):
        step(runner, model, batch)
    done.set()
    watcher.join()
    return {"cpu": max(peak[0] - base, 0)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory", choices=METHODS, help="internal: measure one method's peak memory")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.memory:
        print(json.dumps(peak_memory(args.memory)))
        return 0
    torch.set_num_threads(1)
    runs, forwards = {}, {}
    for method in METHODS:
        model, batch = build()
        runner = prepare(method, model, batch)
        runs[method] = (lambda r=runner, m=model, b=batch: step(r, m, b))
        forwards[method] = (lambda r=runner, b=batch: forward(r, b))
    times = interleaved(runs, rounds=args.rounds, warmup=2)
    ahead = interleaved(forwards, rounds=args.rounds, warmup=1)
    here = os.path.dirname(os.path.abspath(__file__))
    memory = {}
    for method in METHODS:
        done = subprocess.run([sys.executable, os.path.join(here, "bench_hf_pipeline.py"), "--memory", method],
                              capture_output=True, text=True, check=True)
        memory[method] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"devices {devices()}, LlamaForCausalLM 8x256, batch 16x128, chunks 4, 1 intra-op thread")
    anchor = statistics.median(times["accelerate"])
    first = statistics.median(ahead["accelerate"])
    print(f"{'method':20s} {'step best ms':>12s} {'median ms':>10s} {'vs accelerate':>14s} {'forward ms':>11s} "
          f"{'vs accelerate':>14s}  peak memory above start")
    for method in METHODS:
        best, median = min(times[method]) * 1e3, statistics.median(times[method]) * 1e3
        fwd = statistics.median(ahead[method])
        mem = ", ".join(f"{d} {v / 2**20:.0f} MiB" for d, v in memory[method].items())
        print(f"{method:20s} {best:12.0f} {median:10.0f} {anchor * 1e3 / median:13.2f}x {fwd * 1e3:11.0f} "
              f"{first / fwd:13.2f}x  {mem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
