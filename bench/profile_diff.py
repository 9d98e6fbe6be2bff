#!/usr/bin/env python3
"""Where one router spends more CPU per request than another: two sets of py-spy raw stacks
(``bench/router_bench.py --profile DIR``, the same load) compared by function.

    .venv/bin/python bench/profile_diff.py DIR push push@base --rate 250

For each side it reads ``DIR/<target>-c*-*.txt`` and the request counts of the same runs from
``router_bench.py --json FILE`` (``--json``), and prints per function the microseconds of CPU
per request, inclusive (the function and what it calls) and its own, for both sides and their
difference, largest difference first. Samples are of running threads only (py-spy without
``--idle``), so a sample is CPU time of the router. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

from stacks import read_stacks


def _frame(frame: str) -> str:
    """``name (path/file.py:line)`` as ``name (file.py)``: the two sides are different
    checkouts, and their line numbers differ."""
    name, _, where = frame.rpartition(" (")
    if not name:
        return frame
    return f"{name} ({Path(where.rstrip(')').rsplit(':', 1)[0]).name})"


def _functions(stacks: Counter[str]) -> tuple[Counter[str], Counter[str]]:
    """Samples per function: inclusive (once per stack it is in) and its own (at the top)."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for stack, count in stacks.items():
        # py-spy --subprocesses roots each stack at "process PID:..." (a new PID every run).
        frames = [_frame(f) for f in stack.split(";") if not f.startswith("process ")]
        if not frames:
            continue
        for frame in set(frames):
            inclusive[frame] += count
        own[frames[-1]] += count
    return inclusive, own


def _side(folder: Path, target: str, requests: int, rate: int) -> tuple[dict[str, float], ...]:
    stacks: Counter[str] = Counter()
    for path in sorted(folder.glob(f"{target}-c*-*.txt")):
        stacks.update(read_stacks(path))
    inclusive, own = _functions(stacks)
    per_request = 1e6 / rate / requests  # microseconds of CPU per sample, per request
    return (
        {k: v * per_request for k, v in inclusive.items()},
        {k: v * per_request for k, v in own.items()},
    )


def _requests(raw: dict[str, dict[str, Any]], target: str) -> int:
    """The requests of ``target``'s closed-loop runs; a target's runs are a list (older files)
    or a dict by round (``router_bench.py`` now)."""
    total = 0
    for cell, runs in raw.items():
        if cell.startswith("q"):
            continue  # open loop: not profiled under the closed-loop glob
        got = runs.get(target, [])
        for s in got.values() if isinstance(got, dict) else got:
            total += int(s["result"]["requests"])
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("folder", type=Path)
    p.add_argument("target")
    p.add_argument("base")
    p.add_argument("--json", type=Path, required=True, help="router_bench.py --json output")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    raw = json.loads(args.json.read_text())
    sides = {
        name: _side(args.folder, name, _requests(raw, name), args.rate)
        for name in (args.target, args.base)
    }
    for label, index in (("inclusive", 0), ("own", 1)):
        mine, base = sides[args.target][index], sides[args.base][index]
        total = sum(sides[args.target][1].values()), sum(sides[args.base][1].values())
        print(f"\n### {label} CPU per request, us: {args.target} vs {args.base}")
        print(f"(all samples: {total[0]:.0f} vs {total[1]:.0f} us per request)\n")
        print(f"| function | {args.target} | {args.base} | difference |")
        print("|---|---|---|---|")
        keys = sorted(
            mine.keys() | base.keys(), key=lambda k: -abs(mine.get(k, 0) - base.get(k, 0))
        )
        for key in keys[: args.top]:
            a, b = mine.get(key, 0.0), base.get(key, 0.0)
            print(f"| `{key}` | {a:.1f} | {b:.1f} | {a - b:+.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
