"""A hostile lab peer's answer at the byte ceiling: how long decoding it holds the process.

``devicekit status --hosts`` and ``serve --peer`` read at most ``MAX_BYTES`` (4 MiB) of a
peer's body and hand it to :func:`devicekit.serve.peer_document.decode_status` (msgspec into the
peer schema, then the clock and uniqueness checks). Each case below is the worst of its kind
that fits the ceiling; each is timed interleaved against the anchor, the standard library's
``json.loads`` of the same bytes (what parsing cost before the schema, without the pre-scan),
and for the quadratic body of issue 44 item 8 against the old regex pre-scan at 16 KiB (at
64 KiB it took 33 s). Peak memory is measured in a separate, untimed pass (tracemalloc), as a
multiple of the body's size. Decoding holds the GIL while it runs: these milliseconds are the
longest any other thread of ``serve`` waits.

Run: ``python benchmarks/bench_peer_decode.py [--rounds 5]`` (under a minute).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from timing import interleaved  # noqa: E402

from devicekit.serve.peer_document import decode_status  # noqa: E402
from devicekit.serve.peer_fetch import MAX_BYTES, PeerError  # noqa: E402

HEAD = b'{"schema": 1, "gpus": ['
NOW = time.time()


def fill(prefix: bytes, item: bytes, suffix: bytes, sep: bytes = b",") -> bytes:
    """``prefix item,item,... suffix`` as long as fits in MAX_BYTES."""
    count = (MAX_BYTES - len(prefix) - len(suffix)) // (len(item) + len(sep))
    return prefix + sep.join([item] * count) + suffix


def gpu(index: int, **extra: object) -> dict[str, object]:
    return {"index": index, "uuid": f"GPU-{index:08x}-0000-4000-8000-000000000000",
            "name": "NVIDIA H100", "memory_total": 80 * 2**30, "memory_used": 0, **extra}


def largest_valid() -> bytes:
    """64 GPUs with 7 MIG instances each, the most leases the schema allows, long commands."""
    lease = {"gpu_uuid": "GPU-00000000-0000-4000-8000-000000000000", "pid": 4242,
             "user": "alice", "since": NOW - 60, "command": "python train.py " + "x" * 300}
    gpus = []
    for i in range(64):
        migs = [{"index": m, "uuid": f"MIG-{i:04x}{m:04x}-0000-4000-8000-000000000000",
                 "leases": [lease] * 2} for m in range(7)]
        gpus.append(gpu(i, mig_devices=migs, leases=[lease] * 4,
                        processes=[{"pid": 7, "user": "bob", "command": "y" * 300}] * 4))
    return json.dumps({"schema": 1, "taken_at": NOW, "gpus": gpus}).encode()


CASES: dict[str, bytes] = {
    # issue 44 item 8: '"' and then '\"' repeated, never closed (the old pre-scan's regex was
    # quadratic on it), and the same string closed
    "quadratic string": b'{"schema": 1, "gpus": [], "x": "' + b'\\"' * ((MAX_BYTES - 40) // 2),
    "closed string": b'{"schema": 1, "gpus": [], "x": "' + b'\\"' * ((MAX_BYTES - 40) // 2)
                     + b'"}',
    # issue 44 item 10: 5 GPUs x 256 MIG x 256 empty leases (1 MiB), here to the 4 MiB ceiling
    "empty leases": HEAD + b",".join(
        json.dumps(gpu(i, mig_devices=[{"index": m, "uuid": f"MIG-{i}-{m}", "leases": [{}] * 600}
                                       for m in range(256)])).encode() for i in range(5)) + b"]}",
    # the smallest valid list item, far past its list's limit: built, then refused
    "400k tiny processes": fill(HEAD + json.dumps(gpu(0))[:-1].encode() + b', "processes": [',
                                b'{"pid":1}', b"]}]}"),
    # values of a field the schema does not know: skipped
    "2M unknown numbers": fill(b'{"schema": 1, "gpus": [], "x": [', b"0", b"]}"),
    "deep unknown nesting": b'{"schema": 1, "gpus": [], "x": ' + b"[" * (MAX_BYTES // 2 - 40)
                            + b"]" * (MAX_BYTES // 2 - 40) + b"}",
    "4M-digit number": b'{"schema": 1, "gpus": [], "x": 1' + b"0" * (MAX_BYTES - 40) + b"}",
    "escaped text": b'{"schema": 1, "gpus": [], "warnings": ["'
                    + b"\\u00e9" * ((MAX_BYTES - 60) // 6) + b'"]}',
    "largest valid": largest_valid(),
}


def decode(body: bytes) -> Callable[[], object]:
    def run() -> object:
        try:
            return decode_status(body, now=NOW)
        except PeerError as exc:
            return exc
    return run


def stdlib(body: bytes) -> Callable[[], object]:
    def run() -> object:
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as exc:
            return exc
    return run


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(rb"[\[\]{}]")


def old_prescan(body: bytes) -> Callable[[], object]:
    """The pre-scan before issue 44 (peer_fetch.parse_json), without its json.loads."""
    def run() -> object:
        return sum(1 for _ in _BRACKET.finditer(_STRING.sub(b'""', body)))
    return run


def peak_ratio(body: bytes) -> float:
    tracemalloc.start()
    try:
        decode(body)()
        return tracemalloc.get_traced_memory()[1] / len(body)
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"# {platform.machine()}, Python {platform.python_version()}, "
          f"ceiling {MAX_BYTES >> 20} MiB; best of {args.rounds} interleaved rounds")
    print(f"{'case':<22} {'bytes':>9} {'decode_status':>14} {'json.loads':>11} {'ratio':>7} "
          f"{'peak/bytes':>10}  outcome")
    for name, body in CASES.items():
        times = interleaved({"ours": decode(body), "stdlib": stdlib(body)}, rounds=args.rounds)
        ours, anchor = min(times["ours"]), min(times["stdlib"])
        outcome = decode(body)()
        said = f"refused: {str(outcome)[:70]}" if isinstance(outcome, PeerError) else "accepted"
        print(f"{name:<22} {len(body):>9} {ours * 1e3:>11.1f} ms {anchor * 1e3:>8.1f} ms "
              f"{ours / anchor:>6.2f}x {peak_ratio(body):>9.1f}x  {said}")
    small = CASES["quadratic string"][:16 * 1024]
    times = interleaved({"ours": decode(small), "old": old_prescan(small)}, rounds=1, warmup=0)
    print(f"quadratic string at 16 KiB: decode_status {min(times['ours']) * 1e3:.2f} ms, "
          f"the old pre-scan {min(times['old']):.2f} s "
          f"({min(times['old']) / min(times['ours']):.0f}x)")


if __name__ == "__main__":
    main()
