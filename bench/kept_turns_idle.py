"""What a kept turn costs an idle D (pipelined mode, KV that flows back). Not a test.

    .venv/bin/python bench/kept_turns_idle.py --seconds 20 --repeats 2

This project's connector keeps D stepping while it holds a finished turn for the next P (its
worker must answer P's ASK and PULL), napping ``keep_idle_sleep_s`` per empty step. On one
1P1D stack (``Stack("pipelined", kv_return=True)``, D keeping a turn ``--seconds`` + 2 s) the
script measures, each over ``--seconds`` of no traffic, the CPU time (user + system, from
``/proc``, every thread) of D's and P's processes: ``idle`` (nothing kept) and ``kept`` (after
a turn with a session id: D holds it), then waits for D to drop it. Printed: % of one core per
engine and window, and kept/idle for D. The windows alternate within one run, ``--repeats``
times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import httpx

from router.stack import Stack

HISTORY = [{"role": "user", "content": "A long talk. " + "context " * 300}]


def _cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue  # the thread ended
            utime, stime = (int(x) for x in stat.split(") ")[1].split()[11:13])
            total += (utime + stime) / tick
    return total


def _window(stack: Stack, seconds: float) -> dict[str, float]:
    """% of one core per engine over ``seconds`` of no requests."""
    names = [spec.name for spec in stack.engines]
    before = {n: _cpu_seconds(stack.engine_pids(n)) for n in names}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    return {n: 100 * (_cpu_seconds(stack.engine_pids(n)) - before[n]) / wall for n in names}


def _turn(client: httpx.Client, url: str, messages: list[dict[str, str]]) -> str:
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
    r = client.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": "s"})
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"idle": [], "kept": []}
    keep_s = args.seconds + 2
    extra = {"keep_ttl_s": keep_s}
    with (
        open(os.devnull, "w") as log,
        Stack("pipelined", kv_return=True, connector_extra=extra, log=log) as stack,
    ):
        url = stack.router_url
        with httpx.Client(timeout=120) as client:
            client.post(
                url + "/v1/completions", json={"model": "tiny", "prompt": "warm", "max_tokens": 2}
            ).raise_for_status()
            for _ in range(args.repeats):
                rows["idle"].append(_window(stack, args.seconds))
                _turn(client, url, HISTORY)  # D keeps it
                rows["kept"].append(_window(stack, args.seconds))
                time.sleep(keep_s - args.seconds + 1)  # D drops it (nobody asked)
            d = stack.engine_metrics("decode-0")
            kept = d.total("vllm:pdr_turns_kept_total")
            expired = d.total("vllm:pdr_kept_expired_total")
    print(f"\n% of one core over {args.seconds:.0f} s without requests, mean of {args.repeats}")
    print("| window | prefill-0 | decode-0 |")
    print("|---|---|---|")
    for name, windows in rows.items():
        p = statistics.fmean(w["prefill-0"] for w in windows)
        d = statistics.fmean(w["decode-0"] for w in windows)
        print(f"| {name} | {p:.1f} | {d:.1f} |")
    idle = statistics.fmean(w["decode-0"] for w in rows["idle"])
    held = statistics.fmean(w["decode-0"] for w in rows["kept"])
    print(
        f"D kept/idle: {held / max(idle, 0.01):.1f}x; turns kept {kept:.0f}, expired {expired:.0f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
