"""Run ``pd-router`` with Python's allocation tracing on, for the soak's leak hunt.

    python bench/memtrace.py OUT_DIR INTERVAL_S serve --config FILE ...

Starts ``tracemalloc`` (8 frames deep), then the real CLI with the remaining
arguments. A background thread appends a line to ``OUT_DIR/trace.tsv`` every
``INTERVAL_S`` seconds (seconds since start, bytes Python has allocated and still
holds, RSS, GC-tracked objects, collector runs per generation, objects a forced
collection freed) and dumps a snapshot ``OUT_DIR/snap-<s>.pickle``.
Environment ``MEMTRACE_COLLECT=1``: a full collection before each sample;
``MEMTRACE_COLLECT=types``: the same, writing what it freed by type and by frame to
``OUT_DIR/garbage.txt``.
``python bench/memtrace.py --diff OUT_DIR`` compares the snapshot taken at the end of
warm-up with the last one and prints the source lines whose live memory grew most.

Telling a leak from a high-water mark: a leak shows as Python-held bytes (and objects)
that keep growing with the RSS; the allocator keeping freed memory shows as RSS rising
while Python-held bytes stay flat.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
import threading
import time
import tracemalloc
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return -1


def _log_garbage(out: Path, t: int) -> int:
    """Run a full collection and append what it freed (the cycles reference counting
    cannot free), by type and by frame, to ``OUT_DIR/garbage.txt``; returns the count."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        counts = collections.Counter(type(o).__qualname__ for o in gc.garbage)
        # Frames in cycles name the code that made them (an exception's traceback
        # holding the frame that holds the exception, a task, or a future).
        frames = collections.Counter(
            f"{Path(o.f_code.co_filename).name}:{o.f_code.co_name}"
            for o in gc.garbage
            if isinstance(o, types.FrameType)
        )
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
    total = sum(counts.values())
    with open(out / "garbage.txt", "a") as f:
        f.write(f"t={t}s: {total} objects in cycles\n")
        for title, counter in (("by type", counts), ("frames in cycles", frames)):
            f.write(f"  {title}:\n")
            for name, n in counter.most_common(25):
                f.write(f"  {n:7d} {name}\n")
    return total


def _collect(out: Path, t: int, mode: str | None) -> int:
    """The optional full collection before a sample (what is left is reachable: a leak,
    not cycles waiting for the oldest generation); -1 when none ran."""
    if mode == "types":
        return _log_garbage(out, t)
    return gc.collect() if mode == "1" else -1


def _sampler(out: Path, interval_s: float) -> None:
    mode = os.environ.get("MEMTRACE_COLLECT")
    t0 = time.monotonic()
    with open(out / "trace.tsv", "a", buffering=1) as log:
        log.write("seconds\tpython_bytes\trss_bytes\tgc_objects\tgc_runs_by_gen\tcollected\n")
        while True:
            time.sleep(interval_s)
            t = round(time.monotonic() - t0)
            collected = _collect(out, t, mode)
            current, _ = tracemalloc.get_traced_memory()
            runs = "/".join(str(g["collections"]) for g in gc.get_stats())
            log.write(
                f"{t}\t{current}\t{_rss_bytes()}\t{len(gc.get_objects())}\t{runs}\t{collected}\n"
            )
            tracemalloc.take_snapshot().dump(str(out / f"snap-{t:06d}.pickle"))


def _run(out: Path, interval_s: float, frames: int, argv: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    tracemalloc.start(frames)
    threading.Thread(target=_sampler, args=(out, interval_s), daemon=True).start()
    from router.cli import main

    return main(argv)


def diff(out: Path, after_s: float, top: int) -> None:
    """Print the lines whose live memory grew most from the first snapshot at or after
    ``after_s`` to the last one, and the trace table."""
    print((out / "trace.tsv").read_text())
    snaps = sorted(out.glob("snap-*.pickle"))
    first = next((s for s in snaps if int(s.stem.split("-")[1]) >= after_s), snaps[0])
    last = snaps[-1]
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    a = tracemalloc.Snapshot.load(str(first)).filter_traces(ignore)
    b = tracemalloc.Snapshot.load(str(last)).filter_traces(ignore)
    print(f"growth from {first.name} to {last.name}, by line:")
    for stat in b.compare_to(a, "lineno")[:top]:
        print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks  {stat.traceback}")
    print("by traceback (largest growth):")
    for stat in b.compare_to(a, "traceback")[:3]:
        print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks")
        for line in stat.traceback.format():
            print(f"      {line}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--diff":
        p = argparse.ArgumentParser()
        p.add_argument("--diff", type=Path, required=True)
        p.add_argument("--after", type=float, default=120.0, help="seconds: end of warm-up")
        p.add_argument("--top", type=int, default=15)
        a = p.parse_args()
        diff(a.diff, a.after, a.top)
        return
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    out, interval, rest = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    raise SystemExit(_run(out, interval, 8, rest))


if __name__ == "__main__":
    main()
