#!/usr/bin/env python3
"""Instructions one token event costs the migrating relay, counted by callgrind in-process.

Each case runs its step on one vLLM-shaped completion event (compact JSON, token ids asked
for, the client not asking) twice, ``--small`` and ``--large`` times, each in a fresh
interpreter under ``valgrind --tool=callgrind``; the difference over the difference in runs is
the step's instructions per event (start-up cancels out). ``--root`` runs the same cases
against another checkout (a case it lacks is skipped). Cases:

* ``read``: the loop's reading of a read holding one event: split into events
  (``SseEvents.feed``), then ``Progress.client_bytes`` (the first leg's read path);
* ``relayed``: ``Progress.relayed`` alone (the same event found ordinary, ids made null,
  kept for the batch);
* ``take``: ``LegReading.take``, the splice's sink (the scrub, ``relayed``, the stats; the
  client's writer a stub);
* ``loop``: the empty loop (subtract it from the others).

Example::

    .venv/bin/python bench/event_cost.py --root BASE   # BASE: a checkout to compare
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

EVENT = (
    b'data: {"id":"cmpl-abc123def456","object":"text_completion","created":1765000000,'
    b'"model":"fake","choices":[{"index":0,"text":" tok","logprobs":null,'
    b'"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
    b'"token_ids":[12345]}],"usage":null}\n\n'
)
CASES = ("loop", "read", "relayed", "take")


class _Writer:
    def offer(self, body: bytes) -> bool:
        return True

    def ready(self) -> bool:
        return True

    def write(self, body: bytes) -> None:
        pass


class _Watch:
    since: float | None = None


def _step(case: str) -> Any:
    """The callable one event is given to, built from the checkout on sys.path."""
    from router.pd.cut import SseEvents
    from router.pd.progress import Progress

    progress = Progress(chat=False, client_ids=False, include_usage=False)
    progress.identity = {"id": "cmpl-abc123def456"}
    if case == "read":
        events = SseEvents()
        return lambda e: progress.client_bytes(events.feed(e))
    if case == "relayed":
        return progress.relayed
    from router.pd.decode_leg import DecodeLeg
    from router.pd.event_splice import LegReading

    leg = DecodeLeg.__new__(DecodeLeg)  # only its scrub is used
    from router.pd.scrub import StreamScrub

    leg._scrub = StreamScrub()
    reading = LegReading(leg, SseEvents(), progress, _Watch(), time.monotonic, False)  # type: ignore[arg-type]
    reading.writer = _Writer()
    return reading.take


def _child(case: str, n: int) -> None:
    step = (lambda e: None) if case == "loop" else _step(case)
    for _ in range(n):
        step(EVENT)


def _count(root: Path, case: str, n: int) -> int:
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    cmd += [sys.executable, __file__, "--child", case, str(n), "--root", str(root)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    line = next(x for x in out.splitlines() if "Collected" in x)
    return int(line.split()[-1].replace(",", ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", action="append", help="checkouts (default: this one)")
    ap.add_argument("--small", type=int, default=1000)
    ap.add_argument("--large", type=int, default=11000)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    roots = [Path(r).resolve() for r in args.root or [Path(__file__).resolve().parents[1]]]
    if args.child:
        sys.path.insert(0, str(roots[0]))
        _child(args.child[0], int(args.child[1]))
        return 0
    print("| checkout | case | instructions per event |\n|---|---|---|")
    for root in roots:
        for case in CASES:
            try:
                small, large = _count(root, case, args.small), _count(root, case, args.large)
            except subprocess.CalledProcessError:
                print(f"| {root.name} | {case} | - (not in this checkout) |")
                continue
            print(f"| {root.name} | {case} | {(large - small) // (args.large - args.small):,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
