"""The ``/metrics`` page: a status document in Prometheus text format, via ``prometheus-client``.

Every number is one of ``devicekit status --json``'s, unchanged (bytes stay bytes, percent stay
percent, watts, degrees Celsius, seconds since the epoch). Per-GPU gauges carry the labels
``gpu`` (index), ``uuid``, ``name`` and ``hostname`` like dcgm-exporter's; MIG instances add
``mig``. What dcgm-exporter cannot say (its issue #109) comes from devicekit's own facts:
leases by ``user`` and device, per-user memory and processes, and waiting jobs per user when
the fair queue's ``queue`` section is present. Lease metrics carry the lease's ``job`` id, so
an alert can say which job to stop (label ``job_id``: ``job`` is Prometheus's own, the scrape
job, and a target's ``job`` label would be renamed ``exported_job``). Label values are
escaped of control characters and cut to :data:`MAX_LABEL_CHARS`; the lists they come from are
bounded by the status document's ceiling (:mod:`devicekit.sharing.status_ceiling`). For the lab's dashboard and alerts (docs/lab/): how long
each leased GPU has been idle (the sampler's ``idle_since``, :mod:`~devicekit.serve.idle`),
queue waits, free devices and lease directory trouble. Cardinality is bounded: no label per
pid or command, users capped by :data:`devicekit.serve.people.MAX_USERS`. A value the backend
does not know (``null`` in the document) is left out rather than written as 0.

Usage::

    from devicekit.sharing.machine_status import collect_status
    from devicekit.serve.prometheus import render_metrics

    text = render_metrics(collect_status().to_dict()).decode()
    # devicekit_gpu_memory_used_bytes{gpu="0",hostname="lab1",name="NVIDIA H100 ...",uuid="GPU-..."} 2.147483648e+09
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from devicekit.hardware.document_fields import cut
from devicekit.hardware.printable import printable
from devicekit.serve.idle import IDLE_BELOW, is_idle
from devicekit.serve.people import all_leases, queue_tickets, user_totals

__all__ = ["render_metrics", "CONTENT_TYPE", "GPU_GAUGES", "free_devices"]

#: the exposition format's content type (text format 0.0.4)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
GPU_LABELS = ["gpu", "uuid", "name", "hostname"]
MIG_LABELS = ["gpu", "mig", "uuid", "name", "hostname"]
#: ``job_id``, not ``job``: Prometheus owns ``job`` (the scrape job) and would rename ours
LEASE_LABELS = ["gpu", "uuid", "user", "kind", "job_id"]
#: the longest label value written (longer ones end in ``...``)
MAX_LABEL_CHARS = 128
#: warnings of a status document that say the lease directory could not be used as it should
#: (``devicekit.sharing.machine_status.collect_status`` writes them)
LEASE_DIRECTORY_WARNINGS = ("leases not shown:", "queue not shown:", "queue policy ",
                            "lease file")

#: per-GPU gauge -> (status --json key, help)
GPU_GAUGES: dict[str, tuple[str, str]] = {
    "devicekit_gpu_memory_used_bytes": ("memory_used", "GPU memory in use, bytes."),
    "devicekit_gpu_memory_total_bytes": ("memory_total", "GPU memory in all, bytes."),
    "devicekit_gpu_memory_free_bytes": ("memory_free", "GPU memory free, bytes."),
    "devicekit_gpu_utilization_percent": (
        "utilization", "Share of time a kernel was running, percent (not spare capacity)."),
    "devicekit_gpu_memory_bandwidth_utilization_percent": (
        "memory_bandwidth_utilization", "Share of time device memory was read or written, percent."),
    "devicekit_gpu_temperature_celsius": ("temperature", "GPU temperature, degrees Celsius."),
    "devicekit_gpu_power_draw_watts": ("power_draw", "Power drawn, watts."),
    "devicekit_gpu_power_limit_watts": ("power_limit", "Power limit, watts."),
}
#: per-MIG-instance gauge -> (status --json key, help)
MIG_GAUGES: dict[str, tuple[str, str]] = {
    "devicekit_mig_memory_used_bytes": ("memory_used", "MIG instance memory in use, bytes."),
    "devicekit_mig_memory_total_bytes": ("memory_total", "MIG instance memory in all, bytes."),
    "devicekit_mig_memory_free_bytes": ("memory_free", "MIG instance memory free, bytes."),
}


def label(value: Any) -> str:
    """A label value: text, control characters escaped (never obeyed by a terminal that shows
    the page), at most :data:`MAX_LABEL_CHARS` characters."""
    return cut(printable("" if value is None else str(value)), MAX_LABEL_CHARS)


class _Gauge(GaugeMetricFamily):
    """A labelled gauge whose label values are escaped and cut (see :func:`label`)."""

    def add_metric(self, labels: Sequence[str], value: float,  # type: ignore[override]
                   timestamp: float | None = None) -> None:
        super().add_metric([label(v) for v in labels], value, timestamp)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class StatusCollector:
    """A prometheus-client collector over one status document (built once per sample)."""

    def __init__(self, doc: dict[str, Any], *, sample_ok: bool, sample_errors: int) -> None:
        self.doc = doc
        self.sample_ok = sample_ok
        self.sample_errors = sample_errors

    def collect(self) -> Iterator[Metric]:
        yield from self._machine()
        yield from self._gpus()
        yield from self._migs()
        yield from self._leases()
        yield from self._users()
        yield from self._queue()
        yield from self._lab()

    def _machine(self) -> Iterator[Metric]:
        doc = self.doc
        host = str(doc.get("host", {}).get("hostname", ""))
        info = _Gauge(
            "devicekit_info", "devicekit version, GPU backend and driver of this host; always 1.",
            labels=["version", "backend", "driver_version", "cuda_driver_version", "hostname"])
        info.add_metric([str(doc.get("devicekit_version") or ""), str(doc.get("backend") or ""),
                         str(doc.get("driver_version") or ""),
                         str(doc.get("cuda_driver_version") or ""), host], 1)
        yield info
        yield GaugeMetricFamily("devicekit_gpus", "Physical GPUs seen.",
                                value=len(doc.get("gpus", [])))
        yield GaugeMetricFamily("devicekit_status_taken_at_timestamp_seconds",
                                "When the status was taken, seconds since the epoch.",
                                value=float(doc.get("taken_at") or 0))
        yield GaugeMetricFamily("devicekit_sample_ok",
                                "1 when the latest sample succeeded; 0: the numbers are the last "
                                "good ones.", value=1 if self.sample_ok else 0)
        yield CounterMetricFamily("devicekit_sample_errors", "Samples that failed since start.",
                                  value=self.sample_errors)
        yield GaugeMetricFamily("devicekit_status_warnings",
                                "Warnings in the status document (see /api/status).",
                                value=len(doc.get("warnings", [])))

    def _gpus(self) -> Iterator[Metric]:
        host = str(self.doc.get("host", {}).get("hostname", ""))
        gpus = self.doc.get("gpus", [])
        for metric, (key, help_text) in GPU_GAUGES.items():
            family = _Gauge(metric, help_text, labels=GPU_LABELS)
            for gpu in gpus:
                value = _number(gpu.get(key))
                if value is not None:
                    family.add_metric(_gpu_labels(gpu, host), value)
            yield family
        processes = _Gauge("devicekit_gpu_processes",
                                      "Processes holding memory on the GPU.", labels=GPU_LABELS)
        leases = _Gauge("devicekit_gpu_leases",
                                   "devicekit leases on the GPU (its MIG instances included).",
                                   labels=GPU_LABELS)
        for gpu in gpus:
            processes.add_metric(_gpu_labels(gpu, host), len(gpu.get("processes", [])))
            leases.add_metric(_gpu_labels(gpu, host),
                              len(gpu.get("leases", [])) + _count(gpu.get("leases_not_listed")))
        yield processes
        yield leases

    def _migs(self) -> Iterator[Metric]:
        host = str(self.doc.get("host", {}).get("hostname", ""))
        families = {m: _Gauge(m, h, labels=MIG_LABELS) for m, (_, h) in MIG_GAUGES.items()}
        for gpu in self.doc.get("gpus", []):
            for mig in gpu.get("mig_devices", []):
                labels = [str(gpu.get("index")), str(mig.get("index")), str(mig.get("uuid")),
                          str(mig.get("name")), host]
                for metric, (key, _) in MIG_GAUGES.items():
                    value = _number(mig.get(key))
                    if value is not None:
                        families[metric].add_metric(labels, value)
        yield from families.values()

    def _leases(self) -> Iterator[Metric]:
        held: dict[tuple[str, ...], list[float]] = {}
        idle: dict[tuple[str, ...], float] = {}
        now = float(self.doc.get("taken_at") or 0)
        for gpu, lease in all_leases(self.doc):
            key = ("" if gpu is None else str(gpu.get("index")), str(lease.get("gpu_uuid")),
                   str(lease.get("user") or ""), str(lease.get("kind") or "lease"),
                   str(lease.get("job") or ""))
            held.setdefault(key, []).append(float(lease.get("since") or 0))
            if gpu is not None and is_idle(gpu) is not None:  # utilization known: 0 when busy
                since = _number(lease.get("idle_since"))
                idle[key] = max(idle.get(key, 0.0), 0.0 if since is None else max(now - since, 0))
        count = _Gauge(
            "devicekit_lease_holders",
            "devicekit leases one user holds on one device (GPU or MIG instance; gpu is empty "
            "for a device not present here); several only for shared leases.", labels=LEASE_LABELS)
        since = _Gauge(
            "devicekit_lease_since_timestamp_seconds",
            "When the user's oldest lease on the device was taken, seconds since the epoch.",
            labels=LEASE_LABELS)
        idle_seconds = _Gauge(
            "devicekit_lease_idle_seconds",
            f"How long the leased GPU has been idle (utilization below {IDLE_BELOW:g}%) while "
            "the lease held it, as this server saw it; 0 while busy.", labels=LEASE_LABELS)
        for key, times in sorted(held.items()):
            count.add_metric(list(key), len(times))
            since.add_metric(list(key), min(times))
            if key in idle:
                idle_seconds.add_metric(list(key), idle[key])
        yield count
        yield since
        yield idle_seconds

    def _users(self) -> Iterator[Metric]:
        rows = user_totals(self.doc)
        gauges = [
            ("devicekit_user_leased_devices", "Devices (GPUs or MIG instances) the user leases.",
             lambda r: r.leased_devices),
            ("devicekit_user_processes", "The user's processes holding GPU memory.",
             lambda r: r.processes),
            ("devicekit_user_gpu_memory_bytes", "GPU memory the user's processes hold, bytes.",
             lambda r: r.gpu_memory),
            ("devicekit_user_waiting_jobs", "The user's jobs waiting in the queue.",
             lambda r: r.waiting_jobs),
            ("devicekit_user_waiting_gpus", "GPUs the user's waiting jobs ask for.",
             lambda r: r.waiting_gpus),
        ]
        for metric, help_text, value in gauges:
            family = _Gauge(metric, help_text, labels=["user"])
            for row in rows:
                family.add_metric([row.user], value(row))
            yield family

    def _queue(self) -> Iterator[Metric]:
        tickets = queue_tickets(self.doc)
        yield GaugeMetricFamily("devicekit_queue_waiting_jobs",
                                "Jobs waiting in the queue (0 when there is no queue).",
                                value=len(tickets))
        since = [float(t["since"]) for t in tickets if _number(t.get("since")) is not None]
        if since:
            yield GaugeMetricFamily("devicekit_queue_oldest_since_timestamp_seconds",
                                    "When the longest-waiting job joined the queue.",
                                    value=min(since))
        now = float(self.doc.get("taken_at") or 0)
        yield GaugeMetricFamily("devicekit_queue_wait_seconds",
                                "How long the longest-waiting job has waited (0: nobody waits).",
                                value=max(now - min(since), 0.0) if since else 0.0)
        per_user = _Gauge("devicekit_user_queue_wait_seconds",
                                     "How long the user's longest-waiting job has waited.",
                                     labels=["user"])
        for row in user_totals(self.doc):
            if row.waiting_since is not None:
                per_user.add_metric([row.user], max(now - row.waiting_since, 0.0))
        yield per_user

    def _lab(self) -> Iterator[Metric]:
        """What the lab's dashboard and alerts need: free GPUs, lease directory trouble."""
        yield GaugeMetricFamily(
            "devicekit_gpus_free",
            "Devices (GPUs, or MIG instances of a GPU in MIG mode) with no lease, no process, no "
            "squatted lock file and no reservation for a waiting job.", value=free_devices(self.doc))
        warnings = [w for w in self.doc.get("warnings", []) if isinstance(w, str)]
        problems = sum(1 for w in warnings if w.startswith(LEASE_DIRECTORY_WARNINGS))
        problems += sum(1 for g in self.doc.get("gpus", []) if g.get("blocked"))
        yield GaugeMetricFamily(
            "devicekit_lease_directory_problems",
            "Problems with the lease directory: leases or the queue unreadable (wrong owner, "
            "a symlink, permissions), an ignored queue policy, each GPU whose lock file another "
            "user made unusable; 0 when it is fine.", value=problems)
        yield GaugeMetricFamily(
            "devicekit_ignored_lease_files",
            "Live lease files whose content failed the lease schema (another user's junk or "
            "attack): not counted as leases; /api/status lists them with owner and why.",
            value=len(self.doc.get("ignored_leases") or [])
            + _count(self.doc.get("ignored_leases_not_listed")))


def free_devices(doc: dict[str, Any]) -> int:
    """Devices nobody uses or holds: GPUs, or the MIG instances of a GPU in MIG mode."""
    reserved = {str(u) for t in queue_tickets(doc) for u in (t.get("reserved_uuids") or [])}
    leased = {str(lease.get("gpu_uuid")) for _, lease in all_leases(doc)}
    free = 0
    for gpu in doc.get("gpus", []):
        if gpu.get("blocked") or gpu.get("uuid") in reserved:
            continue
        migs = gpu.get("mig_devices") or []
        if gpu.get("mig_enabled") and migs:
            free += sum(1 for m in migs if m.get("uuid") not in leased | reserved
                        and not m.get("leases"))
        elif not gpu.get("mig_enabled") and not gpu.get("leases") and not gpu.get("processes"):
            free += 1
    return free


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _gpu_labels(gpu: dict[str, Any], host: str) -> list[str]:
    return [str(gpu.get("index")), str(gpu.get("uuid")), str(gpu.get("name")), host]


def render_metrics(doc: dict[str, Any], *, sample_ok: bool = True, sample_errors: int = 0) -> bytes:
    """The Prometheus text exposition of a ``devicekit status --json`` document."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(doc, sample_ok=sample_ok,  # type: ignore[arg-type]
                                      sample_errors=sample_errors))
    return generate_latest(registry)
