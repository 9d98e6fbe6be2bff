#!/usr/bin/env python3
"""Where one router does more work per request than another: Python function calls (and
cProfile's own time) per request of two targets, from ``bench/router_bench.py --cprofile DIR
--json FILE`` (the same load for both), compared by function.

    .venv/bin/python bench/call_diff.py DIR pull pull@base --json FILE

Calls are counted, not sampled: the figure does not move with other load on the machine, so a
feature that adds work to every request shows as calls per request even where its CPU time is
within the noise of a throughput run. cProfile's time is inflated by the profiler and only
ranks functions. A coroutine counts one call per resumption. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import pstats
from collections import Counter
from pathlib import Path
from typing import Any

Key = tuple[str, int, str]


def _name(key: Key) -> str:
    path, _, func = key
    where = Path(path).name if path not in ("~", "") else "builtin"
    if "/router/" in path:
        where = "router/" + path.split("/router/")[-1]
    return f"{func} ({where})"


def _side(
    folder: Path, target: str, conc: str, requests: float
) -> tuple[Counter[str], Counter[str]]:
    """Calls and own time (us) per request, by function, summed over the target's runs."""
    calls: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for path in sorted(folder.glob(f"{target}-c{conc}-*.prof")):
        stats = pstats.Stats(str(path)).stats  # {(file, line, name): (cc, calls, own, cum, ...)}
        for key, (_, ncalls, tottime, _, _) in stats.items():
            calls[_name(key)] += ncalls
            own[_name(key)] += tottime * 1e6
    return (
        Counter({k: v / requests for k, v in calls.items()}),
        Counter({k: v / requests for k, v in own.items()}),
    )


def _requests(raw: dict[str, dict[str, Any]], target: str, conc: str) -> float:
    """Requests the target served while profiled (warm-up included, as the CPU figure). Cells
    are ``c64-p200-t64`` (``router_bench.py`` now) or ``64`` (older files); a target's runs a
    dict by round or a list (older)."""
    total = 0.0
    for cell, runs in raw.items():
        if conc != "*" and cell != conc and not cell.startswith(f"c{conc}-"):
            continue
        got = runs.get(target, [])
        total += sum(
            float(s["requests_total"]) for s in (got.values() if isinstance(got, dict) else got)
        )
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("folder", type=Path)
    p.add_argument("target")
    p.add_argument("base")
    p.add_argument("--json", type=Path, required=True, help="router_bench.py --json output")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--concurrency", default="*", help="one concurrency's runs (default: all)")
    args = p.parse_args(argv)
    raw = json.loads(args.json.read_text())
    conc = args.concurrency
    sides = {
        n: _side(args.folder, n, conc, _requests(raw, n, conc)) for n in (args.target, args.base)
    }
    (calls_a, own_a), (calls_b, own_b) = sides[args.target], sides[args.base]
    print(f"\n### calls per request: {args.target} vs {args.base}")
    print(f"(all: {sum(calls_a.values()):.0f} vs {sum(calls_b.values()):.0f})\n")
    print(f"| function | {args.target} | {args.base} | difference | own us (cProfile) |")
    print("|---|---|---|---|---|")
    keys = sorted(calls_a.keys() | calls_b.keys(), key=lambda k: -abs(calls_a[k] - calls_b[k]))
    for key in keys[: args.top]:
        a, b = calls_a[key], calls_b[key]
        print(
            f"| `{key}` | {a:.2f} | {b:.2f} | {a - b:+.2f} | {own_a[key]:.1f} / {own_b[key]:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
