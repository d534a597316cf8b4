"""Who holds a GPU and who is next: leases, lock files, tickets, the fair queue, its policy.

The lease directory (:mod:`.lease_directory`) holds one lock file per device
(:mod:`.device_locks`) and one record per lease (:mod:`.lease_records`); :mod:`.leases` takes
and releases them. Waiting jobs hold tickets (:mod:`.tickets`); :mod:`.queue_order` decides the
order (FIFO, reservations, backfill) from :mod:`.policy` and :mod:`.fair_share`;
:mod:`.queue_state` reads it all at one moment and :mod:`.queue_turn` tells one requester what it
may take. The machine as a whole, facts and holders together, is :mod:`.machine_status`
(``devicekit status``), :mod:`.status_table` (the one renderer of its GPU table, for
``status``, ``status --hosts`` and the pages) and :mod:`.doctor_checks` (``devicekit doctor``).
No torch import.

May import: ``units``, ``errors``, ``hardware``; never torch at module level.
Tests: ``tests/sharing/`` (leases, locks, tickets, queue, policy, status table).

Usage::

    from devicekit.sharing.leases import Lease, read_leases
    from devicekit.sharing.queue_state import look

    with Lease.acquire(["GPU-1234"], command="python train.py") as lease:
        print([r.describe() for r in read_leases()])
"""
