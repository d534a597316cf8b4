"""``devicekit serve``: a live status page, a Prometheus endpoint and the status JSON over HTTP.

A front door like :mod:`devicekit.cli`: it reads :mod:`devicekit.hardware` and :mod:`devicekit.sharing` (no torch) and
nothing imports it but the CLI. One sampler thread takes the status every interval
(:mod:`~devicekit.serve.sampler`); the stdlib HTTP server (:mod:`~devicekit.serve.server`)
hands out what it built: the page (:mod:`~devicekit.serve.page`), ``/metrics``
(:mod:`~devicekit.serve.prometheus`, via prometheus-client) and ``/api/status``.

The lab view reads other hosts' ``devicekit serve``: :mod:`~devicekit.serve.peer_fetch` (one
bounded GET), :mod:`~devicekit.serve.peer_document` (the untrusted answer decoded once, by the schema in
:mod:`~devicekit.serve.peer_schema`, and checked),
:mod:`~devicekit.serve.lab` (every host in parallel), :mod:`~devicekit.serve.lab_hosts`
(``--hosts``, ``DEVICEKIT_HOSTS``, the hosts file), :mod:`~devicekit.serve.lab_table` and
:mod:`~devicekit.serve.lab_choice` (``status --hosts``, ``select --hosts``), and for
``serve --peer`` :mod:`~devicekit.serve.lab_poller` with :mod:`~devicekit.serve.lab_page`
(``/lab``, ``/api/lab``).

Usage::

    from devicekit.serve import StatusServer

    with StatusServer("127.0.0.1", 9400, interval=2.0) as server:
        print("open", server.url)
        input("Enter to stop ")
"""

from __future__ import annotations

from devicekit.serve.server import StatusServer

__all__ = ["StatusServer"]
