"""What a caller asks of selection, checked once: :class:`Request` and :func:`make_request`.

Every later stage of the pipeline (:mod:`.candidates`, :mod:`.ranking`, :mod:`.queue_verdict`,
:mod:`.grant`) reads this one frozen value; bad input is refused here, in one line naming it.

Usage::

    from devicekit.selection.gpu_request import make_request

    request = make_request(2, min_free_memory="20GiB", order="fastest")
    print(request.count, request.min_free)       # 2 21474836480
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from devicekit.errors import InvalidValueError
from devicekit.selection.exclude import parse_exclude
from devicekit.units import parse_percent, parse_size

__all__ = ["ORDERS", "FORMATS", "Request", "make_request"]

ORDERS = ("free-memory", "utilization", "fastest", "index", "random")
FORMATS = ("uuid", "index")


@dataclass(frozen=True)
class Request:
    """A checked request: how many devices, which filters, which order."""

    #: devices wanted; None: every eligible one (``"all"``)
    count: int | None
    min_free: int | None
    max_util: float | None
    exclude: tuple[str, ...]
    order: str
    #: users whose processes' GPU memory counts as free
    account_as_free: frozenset[str]
    share: bool


def _check_count(count: Any) -> int | None:
    if count == "all":
        return None
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InvalidValueError(f"count {count!r} must be a whole number of GPUs >= 1 (or 'all')")
    return count


def make_request(count: Any = 1, *, min_free_memory: Any = None, max_utilization: Any = None,
                 exclude: Iterable[int | str] | int | str = (), order: Any = "free-memory",
                 account_as_free: Iterable[str] | str = (), share: bool = False) -> Request:
    """Check ``select_gpus``'s arguments and freeze them into a :class:`Request`."""
    n = _check_count(count)
    min_free = (parse_size(min_free_memory, name="min_free_memory")
                if min_free_memory is not None else None)
    max_util = (parse_percent(max_utilization, name="max_utilization")
                if max_utilization is not None else None)
    if order not in ORDERS:
        raise InvalidValueError(f"order {order!r} is not one of {', '.join(ORDERS)}")
    users = [account_as_free] if isinstance(account_as_free, str) else list(account_as_free)
    if not all(isinstance(u, str) and u for u in users):
        raise InvalidValueError(f"account_as_free {account_as_free!r} must be user names")
    if share and min_free is None:
        raise InvalidValueError(
            "share=True needs min_free_memory: the memory budget this job claims on a shared GPU"
        )
    return Request(n, min_free, max_util, parse_exclude(exclude), order, frozenset(users),
                   bool(share))
