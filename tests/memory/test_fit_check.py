"""check_fit against a GPU: a step sized on the CPU gets what a CUDA process holds beyond its tensors."""

from __future__ import annotations

from devicekit.memory.fit_check import check_fit, gpu_need
from devicekit.memory.gpu_overhead import gpu_range

GIB = 1 << 30


class _Gpu:
    def __init__(self, free: int, name: str = "NVIDIA GeForce RTX 3060") -> None:
        self.index, self.name, self.utilization = 0, name, 0.0
        self.memory_total, self.memory_free = 12 * GIB, free


def _fit(peak: int, device_type: str, free: int = 12 * GIB):
    return check_fit(peak, peak, peak, device_type, _Gpu(free), convolutions=False)


def test_a_cpu_sized_step_near_the_card_is_not_said_to_fit_outright() -> None:
    peak = int(10.8 * GIB)                     # the user's report: 10.8 GiB of tensors on 12 GiB
    low, expected, high = gpu_range(peak, workspaces_counted=False)
    assert low < 12 * GIB and expected <= 12 * GIB < high
    fit = _fit(peak, "cpu")
    assert fit and "tightly (it may not fit)" in fit.reason and fit.needed == expected
    assert "sized on the CPU; on a GPU nvidia-smi will show about" in fit.reason
    assert "with the CUDA context and cuBLAS workspaces" in fit.reason
    over = _fit(int(11.5 * GIB), "cpu")        # the bare peak is below 12 GiB; the range is not
    assert not over and over.reason.startswith("does not fit gpu0") and "sized on the CPU" in over.reason


def test_a_cpu_sized_step_far_below_the_card_fits() -> None:
    fit = _fit(1 * GIB, "cpu")
    assert fit and fit.reason.startswith("fits gpu0 (NVIDIA GeForce RTX 3060): sized on the CPU")
    assert fit.needed == gpu_range(1 * GIB, workspaces_counted=False)[2]


def test_one_rule_for_cpu_and_cuda_estimates() -> None:
    """Same verdicts from the same range; only the CPU one adds the workspaces and says where it was sized."""
    for peak in (GIB, int(10.8 * GIB), int(11.5 * GIB), 13 * GIB):
        for device_type in ("cpu", "cuda"):
            need = gpu_need(peak, 12 * GIB, device_type=device_type, convolutions=False, name="RTX 3060")
            fit = _fit(peak, device_type)
            assert bool(fit) == need.ok and ("tightly" in fit.reason) == (need.verdict == "may not fit")
            assert ("sized on the CPU" in fit.reason) == (device_type == "cpu")
    cpu = gpu_need(GIB, 12 * GIB, device_type="cpu", convolutions=False)
    cuda = gpu_need(GIB, 12 * GIB, device_type="cuda", convolutions=False)
    assert cpu.expected > cuda.expected and cuda.sized() == ""
    assert _fit(GIB, "cuda").reason.startswith("fits gpu0 (NVIDIA GeForce RTX 3060): needs ")   # as before
