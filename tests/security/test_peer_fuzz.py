"""The peer decoder under hypothesis: random JSON, mutated bodies, and status documents whose
every field is drawn from the values at and past its bounds (issue 44).

For every input, :func:`decode_status` either returns a document within the schema's bounds
(checked here by an independent walk, not by the schema) or raises a one-line
:class:`PeerError` with a reason; no other exception escapes. Every accepted document then goes
through everything that reads a peer's document (the lab page, the lab table, ``select
--hosts``'s judge, ``--hide-commands``, ``/api/lab``'s JSON) without an exception.
"""

from __future__ import annotations

import io
import json
import math
import re
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devicekit.selection.gpu_request import make_request
from devicekit.serve.hidden import hide_commands
from devicekit.serve.lab import HostAnswer, lab_document, lab_json
from devicekit.serve.lab_choice import choose_host
from devicekit.serve.lab_page import render_lab_fragment
from devicekit.serve.lab_table import render_lab
from devicekit.serve.peer_document import MAX_DOCUMENT, PAST_SECONDS, SKEW_SECONDS, decode_status
from devicekit.serve.peer_fetch import PeerAddress, PeerError
from devicekit.serve.peer_schema import (
    MAX_GPU_LEASES,
    MAX_GPUS,
    MAX_MIG,
    MAX_MIG_LEASES,
    MAX_PROCESSES,
    MAX_QUEUE,
    MAX_TEXT,
    MAX_WARNINGS,
    UUID_PATTERN,
)

NOW = time.time()
FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# --- values at every boundary -------------------------------------------------------------------

EDGE_INTS = [0, 1, -1, 100, 101, 255, 256, 65536, 65537, 2**31, 2**31 + 1, 2**32, 2**53 - 1,
             2**53, 2**61, 2**63 - 1, 2**63, 2**64, 10**30]
EDGE_FLOATS = [0.0, -0.0, 0.5, 99.999, 100.0, 100.000001, -1e-9, 250.0, 250.1, 1e5, 1e18, 1e300,
               2.0**61, 4294967296.0, 4294967297.0, NOW, NOW - PAST_SECONDS + 60,
               NOW - PAST_SECONDS - 60, NOW + SKEW_SECONDS - 60, NOW + SKEW_SECONDS + 60,
               631152000.0, 5e-324]
EDGE_TEXT = ["", "a", "x" * 64, "x" * 65, "x" * 300, "x" * 301, "x" * 5000, "\x1b]0;pwn\x07",
             "<script>alert(1)</script>", "\u202eevil", "; rm -rf ~", "GPU-0", "MIG-0", "GPU-",
             "GPU-0\n", "gpu-0", "GPU-" + "a" * 92, "GPU-" + "a" * 93, "\x00", "\ud7ff\ue000"]
UUIDS = ["GPU-0", "GPU-1", "GPU-2", "MIG-0", "MIG-1", "GPU-0", "GPU-8e0b2a3c-1f2d-4e5a-9b6c-7d8e9f0a1b2c",
         "GPU-a; b", "GPU-0\n", "", "GPU-" + "f" * 92, "GPU-" + "f" * 93]

numbers = st.one_of(st.sampled_from(EDGE_INTS), st.sampled_from(EDGE_FLOATS), st.integers(),
                    st.floats(allow_nan=False, allow_infinity=False))
texts = st.one_of(st.sampled_from(EDGE_TEXT), st.text(max_size=40))
anything = st.one_of(st.none(), st.booleans(), numbers, texts, st.lists(st.integers(), max_size=3),
                     st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


def value(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any] = anything,
          odds: int = 30) -> st.SearchStrategy[Any]:
    """Mostly ``good`` (within bounds, at them included); one time in ``odds``, ``bad``: a value
    past a bound, or of another type (so that some documents pass and every field fails some)."""
    return st.integers(0, odds - 1).flatmap(lambda n: bad if n == 0 else good)


def entry(fields: dict[str, st.SearchStrategy[Any]], required: tuple[str, ...] = ()
          ) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({k: fields[k] for k in required},
                                 optional={k: v for k, v in fields.items() if k not in required})


def lists(item: st.SearchStrategy[Any], limit: int) -> st.SearchStrategy[list[Any]]:
    """A short list; now and then one of exactly ``limit`` or one past it (one item repeated)."""
    return value(st.lists(item, max_size=3),
                 st.tuples(item, st.sampled_from([limit, limit + 1])).map(lambda t: [t[0]] * t[1]),
                 odds=8)


def inside(low: float, high: float, edges: list[float]) -> st.SearchStrategy[float]:
    return st.one_of(st.floats(low, high), st.sampled_from([e for e in edges if low <= e <= high]))


def outside(low: float, high: float, edges: list[float]) -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from([e for e in edges if not low <= e <= high]), anything)


def bounded_int(low: int, high: int) -> st.SearchStrategy[Any]:
    return value(st.one_of(st.integers(low, high), st.sampled_from([low, high])),
                 st.one_of(st.sampled_from([e for e in EDGE_INTS if not low <= e <= high]),
                           anything))


def bounded_float(low: float, high: float, odds: int = 30) -> st.SearchStrategy[Any]:
    good = inside(low, high, EDGE_FLOATS)
    return value(st.one_of(good, st.none()), outside(low, high, EDGE_FLOATS), odds)


EARLIEST, LATEST = NOW - PAST_SECONDS + 60, NOW + SKEW_SECONDS - 60
times = bounded_float(EARLIEST, LATEST, odds=4)
pids = bounded_int(0, 2**31)
sizes = bounded_int(0, 2**53 - 1)
free_text = value(st.one_of(texts, st.none()), st.one_of(numbers, st.booleans()))
uuids = value(st.sampled_from([f"GPU-{n}" for n in range(12)] + [f"MIG-{n}" for n in range(12)]
                              + ["GPU-8e0b2a3c-1f2d-4e5a-9b6c-7d8e9f0a1b2c", "GPU-" + "f" * 92]),
              st.sampled_from(UUIDS + EDGE_TEXT))
flags = value(st.booleans())
lease = entry({"gpu_uuid": uuids, "pid": pids, "user": free_text, "host": free_text,
               "command": free_text, "since": times, "memory": sizes, "share": flags,
               "kind": value(st.sampled_from(["lease", "lock"])), "stopped_since": times,
               "job": free_text, "idle_since": times}, required=("gpu_uuid", "pid"))
process = entry({"pid": pids, "user": free_text, "command": free_text, "memory": sizes},
                required=("pid",))
mig = entry({"index": bounded_int(0, 255), "uuid": uuids, "name": value(texts),
             "memory_total": sizes, "memory_used": sizes, "memory_free": sizes,
             "leases": lists(lease, MAX_MIG_LEASES)}, required=("index", "uuid"))
gpu = entry({"index": bounded_int(0, 255), "uuid": uuids, "name": value(texts),
             "memory_total": sizes, "memory_used": sizes, "memory_free": sizes,
             "utilization": bounded_float(0, 100), "temperature": bounded_float(-100, 250),
             "power_draw": bounded_float(0, 1e5), "mig_enabled": flags,
             "blocked": free_text, "mig_devices": lists(mig, MAX_MIG),
             "processes": lists(process, MAX_PROCESSES), "leases": lists(lease, MAX_GPU_LEASES)},
            required=("index", "uuid"))
ticket = entry({"ticket": value(texts), "user": free_text, "pid": pids,
                "gpus_asked": bounded_int(0, 65536), "since": times,
                "time_limit": bounded_float(0, 10 * 366 * 86400),
                "reserved": st.lists(value(texts), max_size=3),
                "reserved_uuids": st.lists(value(st.sampled_from(UUIDS + EDGE_TEXT)), max_size=3),
                "reason": free_text, "backfill": flags}, required=("ticket",))
host = entry({"hostname": free_text, "cpu_count_logical": bounded_int(0, 65536),
              "load_average": value(st.lists(inside(0, 1e6, EDGE_FLOATS), min_size=3, max_size=3),
                                    st.lists(st.sampled_from(EDGE_FLOATS), min_size=2, max_size=4)),
              "memory_total": sizes})
documents = entry({"schema": value(st.just(1), st.sampled_from([0, 2, "1", 1.0, True, None])),
                   "gpus": lists(gpu, MAX_GPUS), "taken_at": times, "host": value(host),
                   "devicekit_version": free_text, "other_leases": st.lists(lease, max_size=2),
                   "warnings": value(st.lists(texts, max_size=MAX_WARNINGS + 3)),
                   "queue": lists(ticket, MAX_QUEUE), "extra": anything},
                  required=("schema", "gpus"))

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, texts),
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.sampled_from(["schema", "gpus", "uuid", "index",
                                                                "leases", "x"]) | st.text(max_size=4),
                                               children, max_size=4)),
    max_leaves=30)


# --- the independent check of an accepted document ----------------------------------------------

_UUID = re.compile(UUID_PATTERN)
LIST_LIMITS = {"gpus": MAX_GPUS, "mig_devices": MAX_MIG, "processes": MAX_PROCESSES,
               "leases": MAX_GPU_LEASES, "queue": MAX_QUEUE, "warnings": MAX_WARNINGS + 1}


def check_bounded(node: Any, key: str = "$") -> None:
    """Every value a renderer may see: finite, bounded numbers; short text; short lists."""
    if isinstance(node, dict):
        for name, child in node.items():
            check_bounded(child, name)
    elif isinstance(node, list):
        assert len(node) <= LIST_LIMITS.get(key, 1024), (key, len(node))
        for child in node:
            check_bounded(child, key)
    elif isinstance(node, bool) or node is None:
        pass
    elif isinstance(node, int):
        assert -2**53 < node < 2**53, (key, node)
    elif isinstance(node, float):
        assert math.isfinite(node) and abs(node) <= 2**32, (key, node)
        if key in ("since", "stopped_since", "idle_since", "taken_at"):
            assert NOW - PAST_SECONDS <= node <= NOW + SKEW_SECONDS, (key, node)
    else:
        assert isinstance(node, str) and len(node) <= MAX_TEXT, (key, len(node))
        if key in ("uuid", "gpu_uuid"):
            assert _UUID.match(node), node


def check_accepted(doc: dict[str, Any]) -> None:
    check_bounded(doc)
    assert len(json.dumps(doc, separators=(",", ":"))) <= MAX_DOCUMENT
    uuids = [g["uuid"].lower() for g in doc["gpus"]]
    uuids += [m["uuid"].lower() for g in doc["gpus"] for m in g["mig_devices"]]
    assert len(uuids) == len(set(uuids))
    assert len({g["index"] for g in doc["gpus"]}) == len(doc["gpus"])
    for g in doc["gpus"]:
        assert len(g["leases"]) <= MAX_GPU_LEASES
        assert all(len(m["leases"]) <= MAX_MIG_LEASES for m in g["mig_devices"])


def every_reader(doc: dict[str, Any]) -> None:
    """What reads a peer's document: none may raise on one the decoder accepted."""
    from rich.console import Console

    answer = HostAnswer(PeerAddress.parse("peer:9400"), doc, None, NOW)
    lab = lab_document([answer, HostAnswer(PeerAddress.parse("down:1"), None, "refused")],
                       now=NOW)
    assert isinstance(render_lab_fragment(lab), str)
    json.loads(lab_json(lab))
    Console(file=io.StringIO(), width=100).print(render_lab([answer]))
    choose_host([answer], make_request(1))
    hidden = hide_commands(doc)
    assert all(p["command"] is None for g in hidden["gpus"] for p in g["processes"])


def decode(data: bytes) -> dict[str, Any] | None:
    try:
        return decode_status(data, now=NOW)
    except PeerError as exc:
        reason = str(exc)
        assert reason and "\n" not in reason and len(reason) < 400, reason
        return None


@FUZZ
@given(documents)
def test_status_documents_at_their_bounds(doc):
    got = decode(json.dumps(doc).encode())
    if got is not None:
        check_accepted(got)
        every_reader(got)


@FUZZ
@given(json_values)
def test_random_json(value):
    got = decode(json.dumps(value).encode())
    if got is not None:
        check_accepted(got)


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes(data):
    assert decode(data) is None or isinstance(decode(data), dict)


VALID = json.dumps({"schema": 1, "taken_at": NOW, "gpus": [
    {"index": 0, "uuid": "GPU-0", "memory_total": 100, "utilization": 5.0, "leases": [
        {"gpu_uuid": "GPU-0", "pid": 4, "since": NOW - 5, "user": "bob", "job": "j1"}],
     "mig_devices": [{"index": 0, "uuid": "MIG-0"}]}],
    "queue": [{"ticket": "3", "since": NOW - 9, "reserved_uuids": ["GPU-0"]}]}).encode()


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.binary(min_size=0, max_size=4)),
                min_size=1, max_size=4), st.integers(0, len(VALID)))
def test_mutated_bodies(edits, cut):
    data = bytearray(VALID)
    for at, replacement in edits:
        data[at:at + len(replacement)] = replacement
    got = decode(bytes(data[:max(cut, 1)]) if cut < 10 else bytes(data))
    if got is not None:
        check_accepted(got)
        every_reader(got)


def test_the_valid_document_is_accepted_whole():
    got = decode(VALID)
    assert got is not None and got["gpus"][0]["leases"][0]["job"] == "j1"
    every_reader(got)
