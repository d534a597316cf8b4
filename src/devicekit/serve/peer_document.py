"""A peer's status document: decoded once from its bytes, checked, rebuilt bounded, or refused.

What another machine's ``devicekit serve`` sends is untrusted. :func:`decode_status` is the one
place its bytes become objects: msgspec decodes them straight into
:class:`~devicekit.serve.peer_schema.PeerStatus` (linear time in C, no pre-scan, no recursion
past Python's own limit), which bounds every field (types, ranges, UUID format, list lengths,
text cut). On top of the schema it checks what needs this machine's view:

- every time (``taken_at``, a lease's ``since``/``stopped_since``/``idle_since``, a ticket's
  ``since``) lies within the past :data:`PAST_SECONDS` and at most :data:`SKEW_SECONDS` ahead
  of this machine's clock;
- no GPU or MIG UUID is listed twice (nor a GPU index), since ``select --hosts`` hands them to
  ``devicekit run --gpu-ids``;
- the rebuilt document, as JSON, is at most :data:`MAX_DOCUMENT` bytes.

What passes is returned as plain JSON data (the checked fields only, each of its documented
type); what fails is one inert :class:`~devicekit.serve.peer_fetch.PeerError` line naming the
bad value and its JSON path, and the host is shown as bad with it. Nothing else is refused
with it: the lab's other hosts are untouched.

Usage::

    from devicekit.serve.peer_document import decode_status

    doc = decode_status(body)     # PeerError: sent a bad status document (... at `$.gpus[0].uuid`)
    doc["gpus"][0]["leases"][0]["job"]
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from devicekit.serve.inert import inert_text
from devicekit.serve.peer_fetch import PeerError
from devicekit.serve.peer_schema import PeerLease, PeerStatus, cut_texts, is_identifier

__all__ = ["decode_status", "is_identifier", "MAX_DOCUMENT", "PAST_SECONDS", "SKEW_SECONDS"]

#: the largest rebuilt document kept from one peer (compact JSON); a real busy 8-GPU host: ~30 KiB
MAX_DOCUMENT = 1024 * 1024
#: how far back a peer's time may lie
PAST_SECONDS = 5 * 366 * 86400
#: how far ahead of this machine's clock a peer's time may lie (clocks of a lab drift apart)
SKEW_SECONDS = 86400

_DECODER = msgspec.json.Decoder(PeerStatus)
_REGEX = re.compile(r"Expected `str` matching regex '.*?'(?= - at)")
_NOT_STATUS = ("at `$`", "at `$.schema`", "field `schema`", "field `gpus`")


def decode_status(body: bytes, *, now: float | None = None) -> dict[str, Any]:
    """The checked, rebuilt status document in ``body``; :class:`PeerError` saying why not."""
    try:
        doc = _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise PeerError(_schema_reason(str(exc))) from None
    except msgspec.DecodeError as exc:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            raise PeerError("sent an answer that is not UTF-8 text") from None
        raise PeerError(f"sent an answer that is not JSON ({inert_text(exc, 80)})") from None
    except RecursionError:
        raise PeerError("sent JSON nested deeper than Python's recursion limit: refused") from None
    cut_texts(doc)
    _check_times(doc, time.time() if now is None else now)
    _check_unique(doc)
    encoded = msgspec.json.encode(doc)
    if len(encoded) > MAX_DOCUMENT:
        raise PeerError(f"sent a status document of {len(encoded) // 1024} KiB once checked, "
                        f"more than the {MAX_DOCUMENT // 1024} KiB kept per host: refused")
    return msgspec.to_builtins(doc)  # type: ignore[no-any-return]


def _schema_reason(message: str) -> str:
    message = _REGEX.sub("not a GPU-/MIG- UUID", message)
    said = inert_text(message, 160)
    if " - at `" not in message or any(words in message for words in _NOT_STATUS):
        return f"did not send a devicekit status document of schema 1 ({said}): is it " \
               "devicekit serve?"
    return f"sent a bad status document ({said}): refused"


def _leases(doc: PeerStatus) -> Iterator[tuple[str, PeerLease]]:
    for g, gpu in enumerate(doc.gpus):
        for n, lease in enumerate(gpu.leases):
            yield f"$.gpus[{g}].leases[{n}]", lease
        for m, mig in enumerate(gpu.mig_devices):
            for n, lease in enumerate(mig.leases):
                yield f"$.gpus[{g}].mig_devices[{m}].leases[{n}]", lease
    for n, lease in enumerate(doc.other_leases):
        yield f"$.other_leases[{n}]", lease


def _times(doc: PeerStatus) -> Iterator[tuple[str, float | None]]:
    yield "$.taken_at", doc.taken_at
    for where, lease in _leases(doc):
        yield f"{where}.since", lease.since
        yield f"{where}.stopped_since", lease.stopped_since
        yield f"{where}.idle_since", lease.idle_since
    for n, ticket in enumerate(doc.queue):
        yield f"$.queue[{n}].since", ticket.since


def _check_times(doc: PeerStatus, now: float) -> None:
    earliest, latest = now - PAST_SECONDS, now + SKEW_SECONDS
    for where, value in _times(doc):
        if value is not None and not earliest <= value <= latest:
            ahead = value > latest
            raise PeerError(
                f"sent a bad status document (the time {value:.17g} at `{where}` is "
                + (f"{(value - now) / 3600:.0f} h ahead of this machine's clock"
                   if ahead else "more than 5 years ago")
                + "): refused")


def _check_unique(doc: PeerStatus) -> None:
    uuids: dict[str, str] = {}
    indices: dict[int, int] = {}
    for g, gpu in enumerate(doc.gpus):
        if gpu.index in indices:
            raise PeerError(f"sent a bad status document (GPU index {gpu.index} at `$.gpus[{g}]` "
                            f"is listed at `$.gpus[{indices[gpu.index]}]` too): refused")
        indices[gpu.index] = g
        named = [(f"$.gpus[{g}].uuid", gpu.uuid)]
        named += [(f"$.gpus[{g}].mig_devices[{m}].uuid", mig.uuid)
                  for m, mig in enumerate(gpu.mig_devices)]
        for where, uuid in named:
            first = uuids.setdefault(uuid.lower(), where)
            if first != where:
                raise PeerError(f"sent a bad status document (UUID {uuid} at `{where}` is "
                                f"listed at `{first}` too): refused")
