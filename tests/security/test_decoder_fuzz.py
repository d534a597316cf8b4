"""The decoders of documents other local users write, under hypothesis: random and adversarial
JSON (numbers at every boundary: ``1e999``, NaN, ``1e300``, ``2**61``, ``-1``; huge strings;
deep nesting; wrong types). No exception but :class:`BadDocument` ever escapes a decoder, and
every document it accepts is within its bounds."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devicekit.errors import InvalidValueError
from devicekit.hardware.bench_cache import BenchDocument
from devicekit.hardware.document_fields import (
    JOB_PATTERN,
    MAX_COUNT,
    PID_MAX,
    UUID_PATTERN,
    BadDocument,
    convert,
    decode,
)
from devicekit.jobs.rank_files import MAX_RANK_FILE, RankFile
from devicekit.memory.batch_size_cache import CachedBatchSize
from devicekit.sharing.fair_share import UsageDocument
from devicekit.sharing.lease_document import MAX_COMMAND_SHOWN, decode_lease
from devicekit.sharing.policy import policy_from_data
from devicekit.sharing.tickets import _record

FUZZ = settings(max_examples=80, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

#: raw JSON number tokens at the boundaries (some are not JSON at all: NaN, Infinity)
NUMBERS = ["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1e300", "-1e300", "1e18",
           str(2**61), str(2**63), str(2**64), "-1", "0", "-0.0", "1e-300", "4194304", "4194305",
           "4294967296", "true", "null", '"12"', "[]", "{}", "1" * 400]
STRINGS = ["", "x" * 100_000, "\x1b]0;t\x07", "GPU-" + "f" * 60_000, "a\nb", "812_3", "\ud800",
           "GPU-1; rm -rf ~", "../../etc/passwd", "é" * 2000]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=50)
    | st.sampled_from(STRINGS),
    lambda children: st.lists(children, max_size=6)
    | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=30)

LEASE = {"gpu_uuid": "GPU-1", "pid": 4242, "host": "lab1", "command": "python t.py",
         "since": 1.7e9, "memory": None, "share": False, "job": "bert-7"}
TICKET = {"version": 1, "seq": 3, "pid": 4242, "host": "lab1", "since": 1.7e9,
          "state": "waiting", "count": 1, "candidates": ["GPU-1"], "command": "python t.py",
          "min_free": None, "max_util": None, "filters": "", "time_limit": None, "grace": 10.0,
          "gpus": [], "ends": None}
USAGE = {"gpu_hours": 1.5, "at": 1.7e9}
RANK = {"request": "1", "rank": 0, "pid": 7, "time": 1.7e9, "torch_seq": 3, "timeout": 600.0,
        "main_stack": [["t.py", 3, "<module>"]], "flight_recorder": None,
        "records": [{"seq": 1, "op": "all_reduce", "group": "0", "shapes": [[2, 3]],
                     "dtypes": ["float32"], "where": "t.py:3", "state": "completed"}]}


def _placeholder(doc: dict[str, Any], key: str, token: str) -> bytes:
    """``doc`` as JSON with ``key``'s value replaced by the raw token (maybe not JSON)."""
    text = json.dumps({**doc, key: "@@TOKEN@@"})
    return text.replace('"@@TOKEN@@"', token).encode()


def adversarial(doc: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """A valid document with one field made hostile, or a random document, or random bytes."""
    keys = st.sampled_from(sorted(doc))
    token = st.sampled_from(NUMBERS) | st.sampled_from(STRINGS).map(json.dumps) | \
        json_values.map(lambda v: json.dumps(v, allow_nan=True)) | \
        st.integers(1, 3_000).map(lambda n: "[" * n + "]" * n)
    return (st.tuples(keys, token).map(lambda kt: _placeholder(doc, *kt))
            | json_values.map(lambda v: json.dumps(v, allow_nan=True).encode())
            | st.dictionaries(keys, json_values).map(
                lambda extra: json.dumps({**doc, **extra}, allow_nan=True).encode())
            | st.binary(max_size=200)
            | st.just(b"[" * 70_000))


def _finite(*values: float | None) -> bool:
    return all(v is None or math.isfinite(v) for v in values)


@FUZZ
@given(adversarial(LEASE))
def test_lease_documents(data: bytes) -> None:
    try:
        doc = decode_lease("GPU-1.4242.tok.lease", data)
    except BadDocument as exc:
        assert str(exc) and "\n" not in str(exc) and len(str(exc)) <= 200
        return
    assert re.fullmatch(UUID_PATTERN, doc.gpu_uuid) and 1 <= doc.pid <= PID_MAX
    assert doc.memory is None or 0 <= doc.memory <= 2**62
    assert doc.job is None or re.fullmatch(JOB_PATTERN, doc.job)
    assert _finite(doc.since) and len(doc.command) <= MAX_COMMAND_SHOWN and len(doc.host) <= 255


class _Info:
    st_uid = os.getuid()
    st_ctime_ns = 1_700_000_000_000_000_000
    st_ctime = 1.7e9
    st_mtime = 1.7e9


@FUZZ
@given(adversarial(TICKET))
def test_ticket_documents(data: bytes) -> None:
    record, why = _record(Path("/x/q.000000003.4242.tok.ticket"), _Info(),  # type: ignore[arg-type]
                          data)
    if record is None:
        assert why.startswith("malformed: ") and len(why) <= 240
        return
    assert record.seq == 3 and record.pid == 4242 and 1 <= record.count <= MAX_COUNT
    assert record.since == 1.7e9  # the file's change time, whatever the ticket says
    assert _finite(record.max_util, record.time_limit, record.grace, record.ends)
    assert record.min_free is None or 0 <= record.min_free <= 2**62
    assert len(record.candidates) <= MAX_COUNT and len(record.gpus) <= MAX_COUNT
    assert all(len(t) <= 200 for t in (record.command, record.host, record.filters))


@FUZZ
@given(adversarial(USAGE))
def test_usage_documents(data: bytes) -> None:
    try:
        usage = decode(data, UsageDocument, limit=4096)
    except BadDocument:
        return
    assert 0 <= usage.gpu_hours <= 1e6 and 0 <= usage.at <= 2**32


@FUZZ
@given(adversarial(RANK))
def test_rank_files(data: bytes) -> None:
    try:
        rank = decode(data, RankFile, limit=MAX_RANK_FILE)
    except BadDocument:
        return
    assert len(rank.main_stack) <= 512 and len(rank.records) <= 100_000
    assert _finite(rank.time, rank.timeout)


policies = st.fixed_dictionaries({}, optional={
    "max_gpus_per_user": json_values | st.integers(),
    "default_time_limit": st.sampled_from(["4h", "1:30:00", "0s", "9999999d", "nan", "1e999h",
                                           "-1h", "5", ""]) | json_values,
    "time_limit_grace": st.sampled_from(["30s", "inf", "1e300s"]) | json_values,
    "fair_share_half_life": st.sampled_from(["7d", "0d"]) | json_values,
    "fair_share_weight": st.floats() | json_values,
    "users": st.dictionaries(st.sampled_from(["alice", "bob", "a b", "x" * 40, "\x1b"]),
                             st.dictionaries(st.sampled_from(["max_gpus", "priority", "x"]),
                                             st.floats() | st.integers() | json_values)),
    "unknown": json_values,
})


@FUZZ
@given(policies)
def test_policies(data: dict[str, Any]) -> None:
    try:
        policy = policy_from_data(data, "policy.toml")
    except (ValueError, InvalidValueError) as exc:
        assert str(exc)
        return
    assert policy.max_gpus_per_user is None or 0 <= policy.max_gpus_per_user <= MAX_COUNT
    assert _finite(policy.default_time_limit, policy.time_limit_grace, policy.fair_share_weight,
                   policy.fair_share_half_life, *policy.priorities.values())
    assert all(0 <= n <= MAX_COUNT for n in policy.user_limits.values())
    assert policy.default_time_limit is None or 0 < policy.default_time_limit <= 366 * 86400


@FUZZ
@given(json_values, json_values)
def test_cache_entries(bench: Any, batch: Any) -> None:
    for data, kind in ((bench, BenchDocument), (batch, CachedBatchSize),
                       ({"matmul_tflops": bench}, BenchDocument), ({"batch_size": batch},
                                                                   CachedBatchSize)):
        try:
            got = convert(data, kind)
        except BadDocument:
            continue
        if isinstance(got, BenchDocument):
            assert all(0 <= v <= 1e5 for v in got.matmul_tflops.values())
        else:
            assert 1 <= got.batch_size <= 2**31


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deep_nesting_is_a_reason_not_a_crash(depth: int) -> None:
    data = b'{"gpu_uuid": "GPU-1", "pid": 1, "x": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(BadDocument):
        decode_lease("GPU-1.1.t.lease", data) if len(data) <= 64 * 1024 else decode(
            data, RankFile, limit=MAX_RANK_FILE)


@pytest.mark.parametrize("value", ["GPU-5d9b\n", "812\n", "bert\n"])
def test_an_identifier_with_a_trailing_newline_is_refused(value: str) -> None:
    """msgspec matches a pattern with ``re.search``: a ``$`` would let ``"812\\n"`` through."""
    from devicekit.hardware.document_fields import BadDocument, GpuUuid, JobId, convert

    for kind in (GpuUuid, JobId):
        with pytest.raises(BadDocument):
            convert(value, kind)
