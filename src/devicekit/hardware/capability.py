"""How strong each GPU is, as one number: the capability score (no torch, no measuring).

The score is the GPU's 16-bit (bf16, else fp16) dense matmul throughput in TFLOP/s, from the
best source at hand:

1. ``"bench"``: measured by ``devicekit bench`` and cached for this GPU's UUID
   (:mod:`devicekit.hardware.bench_cache`); used only when *every* GPU being compared has a
   cached result, so a measured figure is never ranked against a datasheet peak;
2. ``"table"``: the datasheet peak of a known model (:mod:`devicekit.hardware.known_gpus`);
3. ``"facts"``: SM count x boost clock x tensor FLOPs per SM per clock of the architecture
   (from the compute capability), for models not in the table;
4. ``"guess"``: the compute capability alone; ``"unknown"``: nothing to go on (score 1).

``select_gpus(order="fastest")`` sorts by it, ``devicekit run``/``dk.launch`` put the strongest
leased GPU at rank 0, and ``BalancedDataParallel(weights="auto")`` splits batches by it.

Usage::

    import devicekit as dk
    from devicekit.hardware.capability import capabilities, strongest_first

    for gpu, cap in zip(dk.gpus(), capabilities(dk.gpus())):
        print(gpu.index, gpu.name, f"{cap.score:.0f}", cap.source)
    strongest_first(dk.gpus())[0].name
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from devicekit.hardware.bench_cache import read_result
from devicekit.hardware.gpu import GPU
from devicekit.hardware.known_gpus import lookup

__all__ = ["Capability", "capability", "capabilities", "strongest_first", "relative_weights",
           "measured_score"]

# dense fp16 tensor FLOPs per SM per clock, by compute capability (whitepapers: Volta/Turing
# 1024, A100 2048, GA10x/Ada 1024 with fp32 accumulate on datacenter parts, Hopper 4096)
_TENSOR_FLOPS_PER_SM_CLOCK = {(7, 0): 1024, (7, 5): 1024, (8, 0): 2048, (8, 6): 1024,
                              (8, 7): 1024, (8, 9): 1024, (9, 0): 4096}
# rough 16-bit TFLOP/s by compute capability major, when nothing else is known
_GUESS_BY_MAJOR = {6: 20.0, 7: 60.0, 8: 150.0, 9: 700.0, 10: 1500.0}


@dataclass(frozen=True)
class Capability:
    """A GPU's score (16-bit dense matmul TFLOP/s) and where it came from."""

    score: float
    #: "bench", "table", "facts", "guess" or "unknown"
    source: str

    def describe(self) -> str:
        return f"{self.score:.0f} TFLOP/s ({self.source})"


def measured_score(gpu: GPU) -> float | None:
    """The cached bench's 16-bit matmul TFLOP/s for ``gpu`` (None when never benched)."""
    result = read_result(gpu.uuid)
    if not result:
        return None
    tflops = result.get("matmul_tflops")
    if not isinstance(tflops, dict):
        return None
    for dtype in ("bf16", "fp16", "tf32", "fp32"):
        value = tflops.get(dtype)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


def capability(gpu: GPU, *, use_bench: bool = True) -> Capability:
    """The score of one GPU (see the module doc for the order of sources)."""
    if use_bench:
        measured = measured_score(gpu)
        if measured is not None:
            return Capability(measured, "bench")
    known = lookup(gpu.name)
    if known is not None:
        return Capability(known.half_peak, "table")
    cc = gpu.compute_capability
    if cc is not None and gpu.sm_count and gpu.max_sm_clock:
        per_clock = _TENSOR_FLOPS_PER_SM_CLOCK.get(cc, 8192 if cc[0] >= 10 else 1024)
        return Capability(gpu.sm_count * gpu.max_sm_clock * 1e6 * per_clock / 1e12, "facts")
    if cc is not None:
        return Capability(_GUESS_BY_MAJOR.get(cc[0], 10.0 if cc[0] < 6 else 1500.0), "guess")
    return Capability(1.0, "unknown")


def capabilities(gpus: Sequence[GPU]) -> list[Capability]:
    """Scores for GPUs that will be compared: bench figures only if every one has them."""
    measured = [measured_score(g) for g in gpus]
    use_bench = bool(gpus) and all(m is not None for m in measured)
    return [capability(g, use_bench=use_bench) for g in gpus]


def strongest_first(gpus: Sequence[GPU]) -> list[GPU]:
    """``gpus`` sorted by score, strongest first (ties keep their order)."""
    scores = capabilities(gpus)
    order = sorted(range(len(gpus)), key=lambda i: -scores[i].score)
    return [gpus[i] for i in order]


def relative_weights(gpus: Sequence[GPU]) -> list[float]:
    """Each GPU's share of the work in proportion to its score (they sum to 1)."""
    scores = [c.score for c in capabilities(gpus)]
    total = sum(scores)
    return [s / total for s in scores] if total > 0 else [1.0 / len(gpus)] * len(gpus)
