"""Queue tickets in the lease directory: arrival order, liveness, untrusted files, cancel."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from devicekit.errors import InvalidValueError, LeaseError
from devicekit.sharing.lease_directory import lease_dir
from devicekit.sharing.tickets import Ticket, cancel_ticket, read_tickets

FIELDS = {"count": 1, "candidates": ["GPU-a"], "command": "python t.py"}


def test_order_is_arrival_not_the_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    directory = lease_dir()
    first = Ticket.take(directory, FIELDS)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 86400)  # the clock is set back a day
    second = Ticket.take(directory, FIELDS)
    try:
        tickets = read_tickets(directory)
        assert [t.ticket for t in tickets] == [first.ticket, second.ticket]
        # its age is the file's change time (the kernel's clock), never what the writer said
        assert tickets[0].since <= tickets[1].since <= real()
    finally:
        first.close()
        second.close()
    assert read_tickets(directory) == []


def test_malformed_huge_and_dead_ticket_files_are_ignored() -> None:
    directory = lease_dir()
    (directory / "q.000000001.1.aaaa.ticket").write_text("{not json")
    (directory / "q.000000002.1.bbbb.ticket").write_bytes(b"x" * (65 * 1024))
    os.mkfifo(directory / "q.000000003.1.cccc.ticket")
    live = Ticket.take(directory, FIELDS)
    try:
        assert int(live.ticket) == 4  # numbered after every file present
        assert [t.ticket for t in read_tickets(directory)] == ["4"]
    finally:
        live.close()


def test_cancel_removes_a_waiting_ticket_and_refuses_running_or_unknown_ones() -> None:
    directory = lease_dir()
    waiting = Ticket.take(directory, FIELDS)
    running = Ticket.take(directory, {**FIELDS, "state": "running", "gpus": ["GPU-a"]})
    try:
        assert cancel_ticket(directory, waiting.ticket).ticket == waiting.ticket
        assert waiting.cancelled()
        with pytest.raises(LeaseError, match=f"ticket {running.ticket} is running"):
            cancel_ticket(directory, running.ticket)
        with pytest.raises(LeaseError, match="no ticket 99"):
            cancel_ticket(directory, "99")
        with pytest.raises(InvalidValueError, match="'x1'"):
            cancel_ticket(directory, "x1")
        assert not running.cancelled()
        running.update(ends=123.0)  # rewritten atomically, still ours and still locked
        assert not running.cancelled()
        assert [t.ends for t in read_tickets(directory)] == [123.0]
    finally:
        waiting.close()
        running.close()


def test_ticket_file_is_readable_by_all_and_locked(tmp_path: Path) -> None:
    directory = lease_dir()
    ticket = Ticket.take(directory, FIELDS)
    try:
        assert ticket.path.stat().st_mode & 0o777 == 0o644
    finally:
        ticket.close()
    assert not ticket.path.exists()
