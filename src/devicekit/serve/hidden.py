"""``devicekit serve --hide-commands``: a status document with nobody's command line in it.

The sampler applies :func:`hide_commands` to every document before anything is rendered from it,
so the page, ``/fragment``, ``/api/status`` and ``/metrics`` all come from the scrubbed copy and
no renderer has to remember to leave commands out. It removes:

- every ``command`` field: processes, leases (on a GPU, a MIG instance, or no GPU present) and
  the queue's waiting tickets (each becomes ``null``);
- the command quoted inside text: a ticket's ``reason`` (``Busy: GPU 0 leased by alice (pid 9444,
  sleep 60) since 14:02`` becomes ``... by alice (pid 9444) since 14:02``), ``warnings`` (a stopped
  job) and a GPU's ``blocked`` note. User and pid stay.

It fails closed: a ``(pid N, ...`` left in such a text that it cannot account for is cut there
(``(pid N, command hidden)``), and any known command line still found in one is replaced.

Usage::

    from devicekit.serve.hidden import hide_commands

    doc = hide_commands(collect_status().to_dict())   # a copy; the original is untouched
    doc["queue"][0]["command"]                         # None
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from devicekit.hardware.printable import printable

__all__ = ["hide_commands", "HIDDEN"]

#: what a command quoted in a text becomes when it cannot be cut out cleanly
HIDDEN = "command hidden"
#: ``LeaseRecord.describe`` shortens a command past this many characters (37 + "...")
_DESCRIBE_CUT = 40
#: the stopped-job warning quotes ``printable(command)[:60]``
_WARNING_CUT = 60
#: commands shorter than this are not searched for as bare words (they would garble the text)
_MIN_BARE = 6
_PID = re.compile(r"\(pid (\d+), ")
_SHARE_TAIL = re.compile(r"[\d.]+ (?:B|KiB|MiB|GiB|TiB) asked\)")


def _holders(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every entry of the document that has a ``command`` field."""
    for gpu in doc.get("gpus", []):
        yield from gpu.get("processes", [])
        yield from gpu.get("leases", [])
        for mig in gpu.get("mig_devices", []):
            yield from mig.get("leases", [])
    yield from doc.get("other_leases", [])
    queue = doc.get("queue")
    if isinstance(queue, dict):  # tolerate {"tickets": [...]} as serve's people.py does
        queue = queue.get("tickets")
    if isinstance(queue, list):
        yield from (t for t in queue if isinstance(t, dict))


def _shown(command: str) -> set[str]:
    """The forms a command takes when quoted: whole, as ``describe`` cuts it, as printed."""
    forms = {command, printable(command)}
    cut = set()
    for form in forms:
        if len(form) > _DESCRIBE_CUT:
            cut.add(form[:_DESCRIBE_CUT - 3] + "...")
        cut.add(form[:_WARNING_CUT])
    return forms | cut


def _scrub_text(text: str, quoted: dict[str, str], bare: list[str]) -> str:
    for needle in sorted(quoted, key=len, reverse=True):  # longest first: no half-cut command
        if needle in text:
            text = text.replace(needle, quoted[needle])
    match = _PID.search(text)
    while match:  # fail closed: a "(pid N, " whose rest is not a known share tail
        rest = text[match.end():]
        if _SHARE_TAIL.match(rest):
            match = _PID.search(text, match.end())
            continue
        text = f"{text[:match.start()]}(pid {match.group(1)}, {HIDDEN})"
        break
    for command in bare:
        if command in text:
            text = text.replace(command, HIDDEN)
    return text


def hide_commands(doc: dict[str, Any]) -> dict[str, Any]:
    """A copy of a status document with every command line removed (fields ``null``, texts cut)."""
    doc = json.loads(json.dumps(doc))  # a deep copy of plain JSON data
    quoted: dict[str, str] = {}
    bare: set[str] = set()
    for entry in _holders(doc):
        command, pid = entry.get("command"), entry.get("pid")
        entry["command"] = None
        if not isinstance(command, str) or not command:
            continue
        for form in _shown(command):
            if len(form) >= _MIN_BARE:
                bare.add(form)
            if isinstance(pid, int) and not isinstance(pid, bool):
                quoted[f"(pid {pid}, {form}"] = f"(pid {pid}"
    by_length = sorted(bare, key=len, reverse=True)

    def scrub(text: Any) -> Any:
        return _scrub_text(text, quoted, by_length) if isinstance(text, str) else text

    doc["warnings"] = [scrub(w) for w in doc.get("warnings", [])]
    for gpu in doc.get("gpus", []):
        if gpu.get("blocked"):
            gpu["blocked"] = scrub(gpu["blocked"])
    for entry in _holders(doc):
        if "reason" in entry:
            entry["reason"] = scrub(entry["reason"])
    return doc
