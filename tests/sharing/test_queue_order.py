"""The fair queue's pure decision: FIFO, reservations for the head, EASY backfill, quotas."""

from __future__ import annotations

from devicekit.sharing.queue_order import Busy, Waiting, decide

G = [f"GPU-{i}" for i in range(4)]
ALL = frozenset(G)


def busy(*uuids: str, ends: float | None = None, user: str = "carol") -> dict[str, Busy]:
    return {u: Busy(f"leased by {user}", user, ends) for u in uuids}


def test_head_reserves_free_gpus_and_a_later_small_job_waits() -> None:
    head = Waiting("1", "alice", 4, ALL)
    small = Waiting("2", "bob", 1, ALL)
    d1, d2 = decide([head, small], G, busy(G[0], G[1]), now=0.0)
    assert d1.grant == () and d1.reserved == (G[2], G[3])
    assert d1.reason.startswith("Busy: ") and "holds 2 of 4" in d1.reason
    assert d2.grant == () and d2.reason.startswith("Reserved for 1")


def test_later_jobs_take_gpus_no_earlier_ticket_can_use() -> None:
    head = Waiting("1", "alice", 2, frozenset(G[:2]))   # a filter: only GPUs 0 and 1
    small = Waiting("2", "bob", 1, ALL)
    d1, d2 = decide([head, small], G, busy(G[0]), now=0.0)
    assert d1.reserved == (G[1],)
    assert d2.grant == (G[2],)


def test_equal_requests_are_served_in_arrival_order() -> None:
    tickets = [Waiting(str(i), "u", 2, ALL) for i in (1, 2, 3)]
    d = decide(tickets, G, busy(G[0], G[1]), now=0.0)
    assert d[0].grant == (G[2], G[3]) and d[1].grant == () and d[2].grant == ()
    assert d[1].reason.startswith("Busy: GPU-0 leased by carol")


def test_backfill_needs_a_limit_that_ends_before_the_head_could_start() -> None:
    head = Waiting("1", "alice", 2, frozenset(G[:2]))
    short = Waiting("2", "bob", 1, frozenset(G[:2]), time_limit=30.0)
    long = Waiting("3", "bob", 1, frozenset(G[:2]), time_limit=300.0)
    unlimited = Waiting("4", "bob", 1, frozenset(G[:2]))
    held = busy(G[0], ends=100.0)          # its holder's limit frees GPU 0 at t=100 at the latest
    d = decide([head, short], G[:2], held, now=0.0)
    assert d[1].grant == (G[1],) and d[1].backfill
    assert decide([head, long], G[:2], held, now=0.0)[1].grant == ()
    assert decide([head, unlimited], G[:2], held, now=0.0)[1].grant == ()


def test_no_backfill_when_the_holder_has_no_limit() -> None:
    head = Waiting("1", "alice", 2, frozenset(G[:2]))
    short = Waiting("2", "bob", 1, frozenset(G[:2]), time_limit=1.0)
    d = decide([head, short], G[:2], busy(G[0]), now=0.0)   # GPU 0 could free any moment
    assert d[1].grant == () and d[1].reason.startswith("Reserved for 1")


def test_quota_waits_without_reserving_while_others_start() -> None:
    mine = Waiting("1", "alice", 1, ALL)
    theirs = Waiting("2", "bob", 1, ALL)
    d = decide([mine, theirs], G, busy(G[0], G[1], user="alice"), now=0.0, max_gpus_per_user=2)
    assert d[0].grant == () and d[0].reason == "Quota: alice uses 2 of 2 GPU(s), asks 1"
    assert d[0].reserved == ()
    assert d[1].grant == (G[2],)


def test_priority_goes_first_then_arrival() -> None:
    first = Waiting("1", "alice", 2, ALL)
    urgent = Waiting("2", "bob", 2, ALL, priority=5)
    d = decide([first, urgent], G, busy(G[0], G[1]), now=0.0)
    assert [x.ticket for x in d] == ["2", "1"] and d[0].grant == (G[2], G[3])


def test_filter_reason_when_too_few_gpus_pass() -> None:
    w = Waiting("1", "alice", 2, frozenset(G[:1]), filter_note="no 2 GPU(s) with 40GiB free")
    (d,) = decide([w], G, {}, now=0.0)
    assert d.reason == "Filter: no 2 GPU(s) with 40GiB free" and d.grant == ()


def test_a_holder_without_limit_does_not_stop_backfill_when_the_head_needs_limited_ones_too() -> None:
    head = Waiting("1", "alice", 4, ALL)
    short = Waiting("2", "bob", 1, ALL, time_limit=60.0)
    held = {**busy(G[0], G[1], ends=7200.0), **busy(G[2])}   # 0,1 free at 2 h; 2 any moment
    d = decide([head, short], G, held, now=0.0)
    assert d[0].reserved == (G[3],) and d[0].could_start == 7200.0
    assert d[1].grant == (G[3],) and d[1].backfill
