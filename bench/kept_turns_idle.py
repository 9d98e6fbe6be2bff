"""What holding a kept turn costs an idle D. Not a test.

    .venv/bin/python bench/kept_turns_idle.py --seconds 20 --repeats 2

A D that keeps a finished turn for the next turn's P holds its blocks after the request
finished (vLLM's delayed free), and vLLM steps an engine as long as a finished request's
blocks await its connector, requests or not. Per mode, on one 1P1D stack each (``pull``:
vLLM's ``NixlConnector`` with ``bidirectional_kv_xfer``; ``pipelined``: this project's
connector; D keeping a turn ``--seconds`` + 2 s), the script measures over ``--seconds`` of no
traffic the CPU time (user + system, from ``/proc``, every thread) of P's and D's processes:
``idle`` (nothing kept) and ``kept`` (after one non-streamed turn with a session id: D holds
it), then waits for D to drop it; ``--repeats`` times, alternating. Printed: % of one core
per engine and window, and kept/idle for D.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import httpx
from stacks import thread_cpu_seconds  # bench/stacks.py: run as bench/kept_turns_idle.py

from router.stack import Stack

HISTORY = [{"role": "user", "content": "A long talk. " + "context " * 300}]
# The engines' own names for how long D keeps a turn.
TTL_KEY = {"pull": "decoder_kv_blocks_ttl", "pipelined": "keep_ttl_s"}


def _cpu_seconds(pids: list[int]) -> float:
    return sum(seconds for pid in pids for _, seconds in thread_cpu_seconds(pid))


def _window(stack: Stack, seconds: float) -> dict[str, float]:
    """% of one core per engine over ``seconds`` of no requests."""
    names = [spec.name for spec in stack.engines]
    before = {n: _cpu_seconds(stack.engine_pids(n)) for n in names}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    return {n: 100 * (_cpu_seconds(stack.engine_pids(n)) - before[n]) / wall for n in names}


def _turn(client: httpx.Client, url: str, model: str, messages: list[dict[str, str]]) -> None:
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}
    r = client.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": "s"})
    r.raise_for_status()


def run(mode: str, seconds: float, repeats: int) -> dict[str, list[dict[str, float]]]:
    rows: dict[str, list[dict[str, float]]] = {"idle": [], "kept": []}
    keep_s = int(seconds) + 2
    with (
        open(os.devnull, "w") as log,
        Stack(mode, kept_turns=True, connector_extra={TTL_KEY[mode]: keep_s}, log=log) as stack,
        httpx.Client(timeout=120) as client,
    ):
        url, model = stack.router_url, stack.model_name
        warm = {"model": model, "prompt": "warm", "max_tokens": 2}
        client.post(url + "/v1/completions", json=warm).raise_for_status()
        for _ in range(repeats):
            rows["idle"].append(_window(stack, seconds))
            _turn(client, url, model, HISTORY)  # D keeps it
            rows["kept"].append(_window(stack, seconds))
            time.sleep(keep_s - seconds + 2)  # D drops it (nobody asked)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default="pull,pipelined")
    args = ap.parse_args()
    results = {m: run(m, args.seconds, args.repeats) for m in args.modes.split(",")}
    print(f"\n% of one core over {args.seconds:.0f} s without requests, mean of {args.repeats}")
    print("| mode | window | prefill-0 | decode-0 |")
    print("|---|---|---|---|")
    for mode, rows in results.items():
        for name, windows in rows.items():
            p = statistics.fmean(w["prefill-0"] for w in windows)
            d = statistics.fmean(w["decode-0"] for w in windows)
            print(f"| {mode} | {name} | {p:.1f} | {d:.1f} |")
    for mode, rows in results.items():
        idle = statistics.fmean(w["decode-0"] for w in rows["idle"])
        held = statistics.fmean(w["decode-0"] for w in rows["kept"])
        print(f"{mode}: D kept/idle {held / max(idle, 0.01):.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
