"""``devicekit queue``'s text: each column has one meaning (a count of GPUs asked, or which GPUs)."""

from __future__ import annotations

import re
import time

from devicekit.cli.queue import render
from devicekit.sharing.policy import Policy
from devicekit.sharing.queue_order import Decision
from devicekit.sharing.queue_state import QueueEntry, QueueView
from devicekit.sharing.tickets import TicketRecord

LABELS = {f"GPU-{i}": f"GPU {i}" for i in range(4)}


def ticket(number: int, count: int, state: str = "waiting", gpus: tuple[str, ...] = (),
           filters: str = "") -> TicketRecord:
    return TicketRecord(ticket=str(number), seq=number, user="alice", pid=5000 + number,
                        host="lab", command="python train.py", count=count,
                        candidates=tuple(LABELS), min_free=None, max_util=None, filters=filters,
                        since=time.time() - 60, time_limit=7200.0 if state == "running" else None,
                        grace=30.0, state=state, gpus=gpus,
                        ends=time.monotonic() + 3600 if state == "running" else None)


def columns(lines: list[str], name: str) -> dict[str, str]:
    """The first row under the header line holding column ``name``, by column name."""
    index = next(i for i, line in enumerate(lines) if line.startswith("TICKET") and name in line)
    header, row = lines[index], lines[index + 1]
    found = [(m.group(), m.start()) for m in re.finditer(r"\S+(?: \S+)*", header)]
    ends = [start for _, start in found[1:]] + [None]
    return {n: row[start:end].strip() for (n, start), end in zip(found, ends, strict=True)}


def test_waiting_asks_a_count_and_running_names_its_gpus() -> None:
    waiting = QueueEntry(ticket(2, 3, filters="--min-free 40 GiB"),
                         Decision("2", reserved=("GPU-3",), reason="Busy: GPU 0 leased"), LABELS)
    running = ticket(1, 1, state="running", gpus=("GPU-0",))
    view = QueueView((waiting,), (running,), Policy(), LABELS, {})
    lines = render(view.to_dict())
    asks = columns(lines, "ASKS")
    assert asks["ASKS"] == "3 --min-free 40 GiB" and asks["RESERVED"] == "3"
    on = columns(lines, "ON GPUS")
    assert on["ON GPUS"] == "0"  # the job on GPU 0: not "0 GPUs"
    headers = [set(columns(lines, name)) for name in ("ASKS", "ON GPUS")]
    assert all("GPUS" not in h for h in headers)  # no bare GPUS: a count here, an index there


def test_a_long_reason_keeps_how_many_gpus_the_ticket_holds() -> None:
    """Issue 46, item 4: the reason's end, "(holds 1 of 4)", was cut at 60 characters."""
    reason = ("Busy: GPU 1 leased by bob (pid 5383, python big.py --config configs/very/long/path.yaml) "
              "since 15:26 (holds 1 of 4)")
    waiting = QueueEntry(ticket(2, 4), Decision("2", reserved=("GPU-3",), reason=reason), LABELS)
    lines = render(QueueView((waiting,), (), Policy(), LABELS, {}).to_dict())
    shown = columns(lines, "REASON")["REASON"]
    assert shown == reason  # under 120 characters: whole
    longer = reason.replace("long/path", "long/" * 20 + "path")
    waiting = QueueEntry(ticket(2, 4), Decision("2", reserved=("GPU-3",), reason=longer), LABELS)
    shown = columns(render(QueueView((waiting,), (), Policy(), LABELS, {}).to_dict()), "REASON")["REASON"]
    assert shown.startswith("Busy: GPU 1 leased by bob") and shown.endswith("(holds 1 of 4)")
    assert "..." in shown and len(shown) == 120
