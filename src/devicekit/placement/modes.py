"""Speed or reproducibility: the cuDNN, TF32 and determinism switches set together, undoably.

``performance_mode()`` turns on ``cudnn.benchmark`` (the seeds' tip for fixed input sizes) and
TF32 for matmuls and convolutions (``set_float32_matmul_precision("high")``, which also lets
oneDNN use TF32 on CPUs that have it), and turns off deterministic algorithms.
``deterministic_mode()`` does the opposite: no benchmark, no TF32, ``cudnn.deterministic`` and
``torch.use_deterministic_algorithms(True)``, plus ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` when it is
unset (cuBLAS needs it for deterministic results on CUDA >= 10.2; the handle's ``advice`` says so).

Each call applies at once and returns a handle: ``handle.undo()`` restores what was there before,
and the handle is a context manager that undoes on exit.

Usage::

    import devicekit as dk

    dk.performance_mode()                 # for the rest of the run
    with dk.deterministic_mode():         # only inside the block
        check_reproducible(train_step)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["performance_mode", "deterministic_mode", "ModeHandle", "BackendFlags"]

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
_NEW_TF32_API = hasattr(torch.backends.cuda.matmul, "fp32_precision")


@dataclass(frozen=True)
class BackendFlags:
    """A snapshot of every switch the modes touch."""

    cudnn_enabled: bool
    cudnn_benchmark: bool
    cudnn_deterministic: bool
    deterministic_algorithms: bool
    deterministic_warn_only: bool
    tf32: dict[str, Any] = field(default_factory=dict)
    cublas_workspace_config: str | None = None

    @classmethod
    def capture(cls) -> BackendFlags:
        return cls(
            cudnn_enabled=bool(torch.backends.cudnn.enabled),
            cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
            cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
            deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            tf32=_read_tf32(),
            cublas_workspace_config=os.environ.get(CUBLAS_ENV),
        )

    def apply(self) -> None:
        torch.backends.cudnn.enabled = self.cudnn_enabled
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.use_deterministic_algorithms(
            self.deterministic_algorithms, warn_only=self.deterministic_warn_only
        )
        _write_tf32(self.tf32)
        if self.cublas_workspace_config is None:
            os.environ.pop(CUBLAS_ENV, None)
        else:
            os.environ[CUBLAS_ENV] = self.cublas_workspace_config


def _tf32_targets() -> dict[str, Any]:
    """name -> the object whose TF32 switch it is (new ``fp32_precision`` API, torch >= 2.9)."""
    cudnn = torch.backends.cudnn
    targets = {"matmul": torch.backends.cuda.matmul, "conv": cudnn.conv, "rnn": cudnn.rnn}
    mkldnn = getattr(torch.backends.mkldnn, "matmul", None)  # set_float32_matmul_precision moves it
    if mkldnn is not None:
        targets["mkldnn_matmul"] = mkldnn
    return targets


def _read_tf32() -> dict[str, Any]:
    """The legacy switches (None where torch refuses to read them because the new API was
    used) and, on torch >= 2.9, the new ``fp32_precision`` values, so undo restores both."""
    values: dict[str, Any] = {}
    try:
        values["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    except RuntimeError:  # "mix of the legacy and new APIs": only the new values are readable
        values["float32_matmul_precision"] = None
    try:
        values["cudnn_allow_tf32"] = bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        values["cudnn_allow_tf32"] = None
    if _NEW_TF32_API:
        values.update({name: obj.fp32_precision for name, obj in _tf32_targets().items()})
    return values


def _write_tf32(values: dict[str, Any]) -> None:
    """Legacy switches first (torch keeps the new API in step with them, so every reader of
    either API still works), then exact new-API values where they were captured."""
    precision = values.get("float32_matmul_precision")
    if precision is not None:
        torch.set_float32_matmul_precision(precision)
    allow = values.get("cudnn_allow_tf32")
    if allow is not None:
        torch.backends.cudnn.allow_tf32 = allow
    if _NEW_TF32_API:
        targets = _tf32_targets()
        for name, value in values.items():
            if name in targets:
                targets[name].fp32_precision = value


def _tf32(enabled: bool) -> dict[str, Any]:
    """The switches for TF32 on or off, through the legacy setters only. Setting only the new
    ``fp32_precision`` API (torch >= 2.9) leaves ``torch.backends.cuda.matmul.allow_tf32`` and
    ``torch.get_float32_matmul_precision()`` raising "mix of the legacy and new APIs" for every
    later reader (torch.compile's Inductor, Lightning, user code)."""
    precision = "highest"
    if enabled:
        try:
            current = torch.get_float32_matmul_precision()
        except RuntimeError:
            current = "highest"
        precision = "medium" if current == "medium" else "high"  # never slow a faster setting
    return {"float32_matmul_precision": precision, "cudnn_allow_tf32": enabled}


class ModeHandle:
    """Undoes a mode: ``handle.undo()``, or use the handle as a context manager."""

    def __init__(self, name: str, previous: BackendFlags, current: BackendFlags, advice: list[str]) -> None:
        self.name = name
        self.previous = previous
        self.current = current
        self.advice = advice
        self._undone = False

    def undo(self) -> None:
        """Restore the switches as they were before this mode (once; later calls do nothing)."""
        if not self._undone:
            self.previous.apply()
            self._undone = True

    def __enter__(self) -> ModeHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "undone" if self._undone else "active"
        return f"ModeHandle({self.name}, {state})"


def performance_mode() -> ModeHandle:
    """cuDNN on with benchmark mode, TF32 on, deterministic algorithms off."""
    previous = BackendFlags.capture()
    wanted = BackendFlags(
        cudnn_enabled=True,
        cudnn_benchmark=True,
        cudnn_deterministic=False,
        deterministic_algorithms=False,
        deterministic_warn_only=False,
        tf32=_tf32(True),
        cublas_workspace_config=previous.cublas_workspace_config,
    )
    wanted.apply()
    advice = ["cudnn.benchmark helps when input shapes stay the same from step to step"]
    return ModeHandle("performance", previous, wanted, advice)


def deterministic_mode(warn_only: bool = False) -> ModeHandle:
    """cudnn.benchmark off, TF32 off, cudnn.deterministic and deterministic algorithms on.

    ``warn_only=True`` makes ops without a deterministic implementation warn instead of raise.
    """
    previous = BackendFlags.capture()
    advice: list[str] = []
    workspace = previous.cublas_workspace_config
    if workspace not in (":4096:8", ":16:8"):
        workspace = ":4096:8"
        advice.append(
            f"set {CUBLAS_ENV}=:4096:8 in the environment before Python starts: torch reads it "
            "at the first CUDA matmul, so setting it here only helps before that"
        )
    wanted = BackendFlags(
        cudnn_enabled=previous.cudnn_enabled,
        cudnn_benchmark=False,
        cudnn_deterministic=True,
        deterministic_algorithms=True,
        deterministic_warn_only=warn_only,
        tf32=_tf32(False),
        cublas_workspace_config=workspace,
    )
    wanted.apply()
    advice.append("seed every generator too: torch.manual_seed, random.seed, numpy.random.seed")
    return ModeHandle("deterministic", previous, wanted, advice)
