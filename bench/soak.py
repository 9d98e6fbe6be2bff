"""Soak: many concurrent streams for minutes, with random client disconnects and
random engine faults, against fake engines. Not a test: it prints figures.

    .venv/bin/python bench/soak.py --minutes 10 --streams 500 --mode push

Processes: one fake P and one fake D engine (``tests/fakes/fake_vllm.py`` with
``chaos``: each request may get a random fault — an error status, a hang past
the router's timeouts, a stream dropped mid-way, a malformed SSE line or JSON
body, missing ``kv_transfer_params``) in a process of their own, the router
(``pd-router serve``), and this process driving ``--streams`` client loops; a
share of them disconnect at a random moment. Every ``--sample`` seconds it
records the router's RSS and decode slots in use. At the end it waits for
in-flight work to settle and reports outcomes by kind, slots in use (must be
0), requests still open on the fake engines (must be 0), and RSS over time
(must be flat: after warm-up, the last third's median within
``--rss-tolerance`` of the middle third's).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fakes.router_proc import free_port  # noqa: E402


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _start_engines(args: argparse.Namespace, ports: list[int]) -> subprocess.Popen[bytes]:
    """Fake P and D in their own process: the load driver must not starve them."""
    behaviour = {
        "tokens": 16,
        "token_delay": args.token_delay,
        "chaos": args.fault_rate,
        "chaos_hang": 5.0,
        "transfer_mode": "push" if args.mode == "push" else "pull",
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.fakes.run_fake",
            ",".join(map(str, ports)),
            json.dumps(behaviour),
        ],
        cwd=ROOT,
    )


async def _metric_sum(client: httpx.AsyncClient, url: str, prefix: str) -> float:
    """Sum of the samples on ``url``'s /metrics page whose line starts with ``prefix``."""
    text = (await client.get(url + "/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


async def _engine_metrics(client: httpx.AsyncClient, url: str) -> float:
    """Generate requests the fake engine still has open (it reports them as running)."""
    return await _metric_sum(client, url, "vllm:num_requests_running")


def _router_config(args: argparse.Namespace, p_url: str, d_url: str, port: int) -> dict[str, Any]:
    prefill: dict[str, Any] = {"url": p_url}
    if args.mode == "push":
        prefill |= {"engine_id": "soak-p", "kv_host": "127.0.0.1", "kv_port": 5600}
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "log_level": "error",
        "models": [
            {
                "name": "tiny",
                "mode": args.mode,
                "prefill": [prefill],
                "decode": [{"url": d_url, "slots": args.streams}],
            }
        ],
        "timeouts": {"prefill": 2, "decode_first_byte": 3, "idle": 2, "total": 30},
        "admission": {"queue_size": args.streams * 2, "max_wait": 10},
        "retries": {"max_attempts": 2, "backoff_initial": 0.01},
        # Faults are injected on purpose: keep the breakers from taking the only
        # engines out of rotation, which would turn the soak into a 503 test.
        "breaker": {"failure_threshold": 1_000_000, "open_seconds": 1},
        "health": {"interval": 2, "timeout": 2},
    }


def _outcome(status: int, text: str) -> str:
    if status != 200:
        return f"http_{status}"
    if '"error"' in text:
        return "sse_error_event"
    return "ok" if "[DONE]" in text else "truncated"


class OpenStreams:
    """Client requests in flight right now (the concurrency the router really holds)."""

    def __init__(self) -> None:
        self.now = 0
        self.seen: list[int] = []


async def _client_loop(
    url: str,
    stop: float,
    args: argparse.Namespace,
    outcomes: collections.Counter[str],
    open_streams: OpenStreams,
) -> None:
    body = {"model": "tiny", "prompt": "soak " * 40, "max_tokens": 16, "stream": True}
    stream_s = 16 * args.token_delay
    # A client of its own per loop: httpx's pool scans all its connections on every
    # request, which with 500 streams in one client made this process the bottleneck.
    async with httpx.AsyncClient(timeout=60) as client:
        await _requests(client, url, stop, args, body, stream_s, outcomes, open_streams)


async def _requests(
    client: httpx.AsyncClient,
    url: str,
    stop: float,
    args: argparse.Namespace,
    body: dict[str, Any],
    stream_s: float,
    outcomes: collections.Counter[str],
    open_streams: OpenStreams,
) -> None:
    while time.monotonic() < stop:
        leave = random.random() < args.disconnect_rate
        leave_after = random.uniform(0.0, stream_s) if leave else None
        open_streams.now += 1
        try:
            async with (
                asyncio.timeout(leave_after),
                client.stream("POST", url + "/v1/completions", json=body) as r,
            ):
                chunks = [c async for c in r.aiter_bytes()]
                outcomes[_outcome(r.status_code, b"".join(chunks).decode("utf-8", "replace"))] += 1
        except TimeoutError:
            outcomes["client_disconnect"] += 1
        except httpx.HTTPError as exc:
            outcomes[f"client_saw_{type(exc).__name__}"] += 1
        finally:
            open_streams.now -= 1


async def _slots_in_use(client: httpx.AsyncClient, url: str) -> float:
    return await _metric_sum(client, url, "pdrouter_decode_slots_in_use{")


async def _sample(
    client: httpx.AsyncClient,
    url: str,
    pid: int,
    stop: float,
    args: argparse.Namespace,
    samples: list[tuple[float, float, float]],
    open_streams: OpenStreams,
) -> None:
    t0 = time.monotonic()
    next_print = t0
    while time.monotonic() < stop:
        await asyncio.sleep(1.0)
        t = time.monotonic() - t0
        if t >= args.warmup:
            open_streams.seen.append(open_streams.now)
        if time.monotonic() < next_print:
            continue
        next_print += args.sample
        with contextlib.suppress(httpx.HTTPError):
            slots = await _slots_in_use(client, url)
            samples.append((t, _rss_mb(pid), slots))
            print(
                f"  t={t:6.0f}s rss={samples[-1][1]:7.1f} MB slots={slots:.0f} "
                f"open streams={open_streams.now}",
                flush=True,
            )


async def _settle(client: httpx.AsyncClient, url: str, engines: list[str]) -> tuple[float, float]:
    deadline = time.monotonic() + 40
    while True:
        slots = await _slots_in_use(client, url)
        open_upstream = sum([await _engine_metrics(client, e) for e in engines])
        if (slots == 0 and open_upstream == 0) or time.monotonic() > deadline:
            return slots, open_upstream
        await asyncio.sleep(0.5)


async def run(args: argparse.Namespace) -> int:
    ports = [free_port(), free_port()]
    engines = [f"http://127.0.0.1:{p}" for p in ports]
    engine_proc = _start_engines(args, ports)
    r_port = free_port()
    cfg = _router_config(args, *engines, port=r_port)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(cfg, f)
    serve = ["serve", "--config", f.name, "--grace", "2"]
    launcher = ["-m", "router"]
    if args.trace_dir is not None:  # allocation tracing (slower): see bench/memtrace.py
        launcher = [str(ROOT / "bench" / "memtrace.py"), str(args.trace_dir), str(args.sample)]
    router = subprocess.Popen(
        [sys.executable, *launcher, *serve],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{r_port}"
    limits = httpx.Limits(max_connections=args.streams + 16, max_keepalive_connections=args.streams)
    try:
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(url + "/ready")).status_code == 200:
                        break
                await asyncio.sleep(0.2)
            outcomes: collections.Counter[str] = collections.Counter()
            samples: list[tuple[float, float, float]] = []
            open_streams = OpenStreams()
            stop = time.monotonic() + args.minutes * 60
            print(
                f"soak: {args.streams} streams, {args.minutes} min, mode {args.mode}, "
                f"fault rate {args.fault_rate}, disconnect rate {args.disconnect_rate}"
            )
            await asyncio.gather(
                _sample(client, url, router.pid, stop, args, samples, open_streams),
                *(
                    _client_loop(url, stop, args, outcomes, open_streams)
                    for _ in range(args.streams)
                ),
            )
            final_slots, open_upstream = await _settle(client, url, engines)
        return _report(args, outcomes, samples, open_streams, final_slots, open_upstream)
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(30)
        engine_proc.terminate()
        engine_proc.wait(10)
        os.unlink(f.name)


def _report(
    args: argparse.Namespace,
    outcomes: collections.Counter[str],
    samples: list[tuple[float, float, float]],
    open_streams: OpenStreams,
    final_slots: float,
    open_upstream: float,
) -> int:
    total = sum(outcomes.values())
    print(f"\nrequests: {total} ({total / (args.minutes * 60):.0f}/s)")
    seen = open_streams.seen or [0]
    print(
        f"client streams open after warm-up (1 s samples): median {statistics.median(seen):.0f}, "
        f"min {min(seen)}, max {max(seen)} of {args.streams}"
    )
    for kind, n in outcomes.most_common():
        print(f"  {kind:32s} {n:8d}  {100 * n / max(total, 1):5.1f}%")
    print(f"decode slots in use at the end: {final_slots:.0f} (must be 0)")
    print(f"requests still open on the fake engines: {open_upstream:.0f} (must be 0)")
    steady = [rss for t, rss, _ in samples if t >= args.warmup]
    third = max(1, len(steady) // 3)
    thirds = [
        statistics.median(steady[i * third : (i + 1) * third] or steady[-1:]) for i in range(3)
    ]
    # A leak keeps growing; a high-water mark (a burst's buffers kept by the allocator)
    # steps up once and stays. Flat: the last third within tolerance of the middle one.
    growth = (thirds[2] - thirds[1]) / thirds[1]
    print(
        "router RSS by thirds of the run after warm-up: "
        + ", ".join(f"{x:.1f} MB" for x in thirds)
        + f" (last vs middle {100 * growth:+.1f}%; flat means within "
        f"{100 * args.rss_tolerance:.0f}%)"
    )
    ok = final_slots == 0 and open_upstream == 0 and growth <= args.rss_tolerance
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--streams", type=int, default=500)
    p.add_argument("--mode", choices=["pull", "push", "push-sequential"], default="push")
    p.add_argument("--fault-rate", type=float, default=0.02, help="per engine request")
    p.add_argument("--disconnect-rate", type=float, default=0.1, help="per client request")
    p.add_argument(
        "--token-delay",
        type=float,
        default=0.25,
        help="seconds between the 16 streamed tokens: long streams keep --streams open "
        "at a request rate this process (the client) sustains on a shared 2-core machine",
    )
    p.add_argument("--sample", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before RSS counts")
    p.add_argument("--rss-tolerance", type=float, default=0.10)
    p.add_argument(
        "--trace-dir",
        type=Path,
        default=None,
        help="run the router under tracemalloc, a snapshot every --sample seconds in this "
        "folder; then: python bench/memtrace.py --diff DIR",
    )
    args = p.parse_args()
    raise SystemExit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
