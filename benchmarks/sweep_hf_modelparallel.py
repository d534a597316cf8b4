"""Sweep every transformers causal-LM and masked-LM architecture through dk.split and dk.Pipeline at 2 stages.

For each architecture in transformers' auto mappings (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
``MODEL_FOR_MASKED_LM_MAPPING_NAMES``) the model is built from a tiny config (hidden 32, 2-3
layers, vocabulary 128, dropout 0; random weights, offline) and run on a token batch
(``input_ids``, ``attention_mask``, ``labels``). An architecture that does not build from such a
config or does not run on such a batch unsplit is left out of the tally (listed as ``skip``).
Each one that runs is then:

* split over ``["cpu", "cpu"]`` with the batch as sample: loss, logits and every gradient
  compared with the unsplit model on the whole batch;
* pipelined over ``["cpu", "cpu"]`` with ``chunks=2``, two training calls (the first in the
  calling thread, the second overlapped in threads): loss, logits and every gradient compared
  with the unsplit model on the same two micro-batches, joined as documented.

Each result is ``equal`` (bit for bit), ``refused`` (a DeviceKitError: its first words are
shown), ``DIFFERENT`` (ran, but not equal: the failure that must not happen) or ``ERROR`` (an
exception that is not a refusal). Not part of ``make test``.

Usage::

    .venv/bin/python benchmarks/sweep_hf_modelparallel.py                 # everything (~10 min, 2 cores)
    .venv/bin/python benchmarks/sweep_hf_modelparallel.py --only llama,bert --json sweep.json
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import signal
import sys
import time
import warnings
from typing import Any

import torch
from torch import nn

import devicekit as dk

VOCAB = 128
TINY = {
    "vocab_size": VOCAB, "hidden_size": 32, "n_embd": 32, "d_model": 32, "embed_dim": 32, "dim": 32,
    "num_hidden_layers": 3, "n_layer": 3, "n_layers": 3, "num_layers": 3, "encoder_layers": 2, "decoder_layers": 2,
    "num_decoder_layers": 2, "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_heads": 4, "num_key_value_heads": 2, "multi_query_group_num": 2,
    "intermediate_size": 64, "ffn_dim": 64, "n_inner": 64, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "d_ff": 64,
    "max_position_embeddings": 64, "n_positions": 64, "max_seq_len": 64, "seq_length": 64, "head_dim": 8,
    "d_kv": 8, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "embedding_size": 32, "hidden_act": None, "router_jitter_noise": 0.0, "sliding_window": None,
}
RANDOM = ("dropout", "pdrop", "drop_path", "layerdrop", "jitter")


class Timeout(BaseException):  # not an Exception: no handler inside devicekit or transformers turns it into one
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Timeout("timed out")


#: overrides left out on a second try (sizes some configs derive from others), and kept on a third
DERIVED = {"head_dim", "d_kv", "num_key_value_heads", "multi_query_group_num", "embed_dim", "dim", "n_inner",
           "moe_intermediate_size", "shared_expert_intermediate_size", "embedding_size"}
DEPTH = {"vocab_size", "num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers",
         "decoder_layers", "num_decoder_layers", "max_position_embeddings", "n_positions", "num_experts",
         "num_local_experts", "n_routed_experts", "moe_num_experts", "router_jitter_noise"}


def tiny_config(model_type: str, attempt: int = 0) -> Any:
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    keep = [lambda k: True, lambda k: k not in DERIVED, lambda k: k in DEPTH][attempt]
    overrides = {k: v for k, v in TINY.items() if v is not None and hasattr(default, k) and keep(k)}
    for key, value in vars(default).items():
        if isinstance(value, float) and any(word in key for word in RANDOM):
            overrides[key] = 0.0
        if key.endswith("token_id") and isinstance(value, int) and value >= 4:
            overrides[key] = 2
    config = AutoConfig.for_model(model_type, **overrides)
    config.use_cache = False
    return config


def _call(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    extra = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    return model(**batch, **extra)


def _logits(out: Any) -> torch.Tensor:
    found = getattr(out, "logits", None)
    if isinstance(found, torch.Tensor):
        return found
    return next(v for v in out.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def _grads(model: nn.Module, ref: nn.Module) -> str:
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if (p.grad is None) != (q.grad is None):
            return f"{name}: grad {'missing' if p.grad is None else 'extra'}"
        if p.grad is not None and not torch.equal(p.grad, q.grad):
            return f"{name}: grad differs by {(p.grad - q.grad).abs().max().item():.2e}"
    return ""


def build(model_type: str, class_name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model from the first of three ever smaller sets of tiny overrides that builds and runs."""
    failure: Exception | None = None
    for attempt in range(3):
        try:
            return _build(model_type, class_name, attempt)
        except Exception as exc:  # noqa: PERF203  (a config that does not take these sizes: try fewer)
            failure = failure or exc
    assert failure is not None
    raise failure


def _build(model_type: str, class_name: str, attempt: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers

    cls = getattr(transformers, class_name)
    config = tiny_config(model_type, attempt)
    with torch.device("meta"):
        size = sum(p.numel() for p in cls(config).parameters())
    if size > 20_000_000:
        raise RuntimeError(f"not tiny: {size:,} parameters")
    torch.manual_seed(0)
    model = cls(config).train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (4, 8), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    with torch.no_grad():
        out = _call(copy.deepcopy(model), batch)
    if getattr(out, "loss", None) is None:
        raise RuntimeError("no loss from labels")
    return model, batch


def _status(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, dk.DeviceKitError):
        return "refused: " + text[:160]
    return f"ERROR: {type(exc).__name__}: {text[:160]}"


def check_split(model: nn.Module, batch: dict[str, torch.Tensor]) -> str:
    ref = copy.deepcopy(model)
    try:
        split = dk.split(model, ["cpu", "cpu"], sample=batch)
        out = _call(split, batch)
    except Exception as exc:
        return _status(exc)
    want = _call(ref, batch)
    if not (torch.equal(out.loss, want.loss) and torch.equal(_logits(out), _logits(want))):
        return "DIFFERENT: loss or logits"
    out.loss.backward()
    want.loss.backward()
    bad = _grads(model, ref)
    return f"DIFFERENT: {bad}" if bad else "equal"


def check_pipeline(model: nn.Module, batch: dict[str, torch.Tensor]) -> str:
    ref = copy.deepcopy(model)
    try:
        pipe = dk.Pipeline(model, ["cpu", "cpu"], chunks=2, sample=batch)
    except Exception as exc:
        return _status(exc)
    try:
        for step in range(2):
            for p in (*model.parameters(), *ref.parameters()):
                p.grad = None
            try:
                out = pipe(**batch)
            except Exception as exc:
                return _status(exc)
            outs = [_call(ref, {k: v[i:i + 2] for k, v in batch.items()}) for i in (0, 2)]
            loss = torch.stack([o.loss for o in outs]).mean()
            logits = torch.cat([_logits(o) for o in outs])
            if not torch.equal(out.loss, loss):
                return f"DIFFERENT: loss (call {step + 1}) by {(out.loss - loss).abs().item():.2e}"
            if not torch.equal(_logits(out), logits):
                return f"DIFFERENT: logits (call {step + 1})"
            out.loss.backward()
            loss.backward()
            bad = _grads(model, ref)
            if bad:
                return f"DIFFERENT: {bad} (call {step + 1})"
        return "equal"
    finally:
        pipe.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per architecture")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import transformers
    from transformers.models.auto import modeling_auto

    transformers.logging.set_verbosity_error()
    kinds = {**{t: c for t, c in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()},
             **{f"{t} (masked)": c for t, c in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES.items()}}
    only = {o.strip() for o in args.only.split(",") if o.strip()}
    seen: set[str] = set()
    results = []
    signal.signal(signal.SIGALRM, _alarm)
    for key, class_name in kinds.items():
        model_type = key.removesuffix(" (masked)")
        if (only and model_type not in only) or class_name in seen or not hasattr(transformers, class_name):
            continue
        seen.add(class_name)
        row = {"type": model_type, "class": class_name}
        start = time.perf_counter()
        signal.alarm(args.timeout)
        try:
            model, batch = build(model_type, class_name)
            row["split"] = check_split(copy.deepcopy(model), batch)
            row["pipeline"] = check_pipeline(model, batch)
        except Timeout:
            row.setdefault("split", "skip: timed out")
            row["pipeline"] = row.get("pipeline", "ERROR: timed out" if "split" in row else "skip: timed out")
        except Exception as exc:  # does not build from a tiny config, or does not run on a token batch
            row["split"] = row["pipeline"] = f"skip: {type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
        finally:
            signal.alarm(0)
        row["seconds"] = round(time.perf_counter() - start, 1)
        results.append(row)
        print(f"{class_name:45s} split: {row['split'][:70]:70s} pipeline: {row['pipeline'][:90]}", flush=True)
    ran = [r for r in results if not r["split"].startswith("skip")]
    print(f"\n{len(results)} architectures, {len(ran)} build from a tiny config and run on a token batch")
    for what in ("split", "pipeline"):
        tally = {k: sum(r[what].startswith(k) for r in ran) for k in ("equal", "refused", "DIFFERENT", "ERROR")}
        share = 100 * tally["equal"] / max(len(ran), 1)
        print(f"{what:9s}: " + ", ".join(f"{k} {v}" for k, v in tally.items()) + f"  ({share:.1f} % equal)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if any(r[w].startswith(("DIFFERENT", "ERROR")) for r in ran for w in ("split", "pipeline")) else 0


if __name__ == "__main__":
    sys.exit(main())
