"""The names a step can be given, without importing torch: the CLI checks its flags with them.

Usage::

    from devicekit.memory.step_names import check_step_names

    check_step_names(optimizer="lion")     # InvalidValueError at once, before torch is imported
"""

from __future__ import annotations

from devicekit.errors import InvalidValueError

__all__ = ["LOSS_NAMES", "OPTIMIZER_NAMES", "PRECISION_NAMES", "check_step_names"]

OPTIMIZER_NAMES = ("adam", "adamw", "sgd", "sgd-momentum", "momentum", "rmsprop", "adagrad", "adafactor",
                   "adadelta", "adamax", "nadam", "radam", "sparse-adam")
PRECISION_NAMES = ("fp32", "float32", "none", "bf16", "bfloat16", "fp16", "float16", "half")
LOSS_NAMES = ("cross-entropy", "mse", "sum")


def check_step_names(*, optimizer: str | None = None, precision: str | None = None,
                     loss: str | None = None) -> None:
    """Raise a one-line error naming the first unknown name; None means not given."""
    if optimizer is not None and optimizer.lower() not in (*OPTIMIZER_NAMES, "none"):
        raise InvalidValueError(f"optimizer {optimizer!r} is unknown; use one of "
                                f"{', '.join(OPTIMIZER_NAMES)} or none")
    if precision is not None and precision.lower() not in PRECISION_NAMES:
        raise InvalidValueError(f"precision {precision!r} is unknown; use bf16, fp16 or fp32")
    if loss is not None and loss.lower() not in LOSS_NAMES:
        raise InvalidValueError(f"loss {loss!r} is unknown; use one of {', '.join(LOSS_NAMES)}")
