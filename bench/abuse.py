"""Abuse benchmark: what normal traffic sees while other clients abuse the router.
Not a test: it prints figures.

    .venv/bin/python bench/abuse.py --seconds 20 --rate 8

Processes: a fake decode engine (``python -m tests.fakes.run_fake``, aggregated mode:
the abuse is the router's business, not the P/D split), the router (``pd-router serve``
from a YAML config written to a temporary file, so its real uvicorn protocol with the
connection bounds), this driver (the normal traffic, measured) and, during the abuse
phase, a second instance of this script that runs the abusers, so that their event loop
cannot delay the measurement.

Two phases of ``--seconds`` each, in one run:

* ``quiet``: normal traffic alone: ``--rate`` streaming completions per second, open
  loop (Poisson arrivals, each request a task of its own), with the key ``normal``;
* ``abuse``: the same normal traffic, and at the same time (the keys ``flood`` and
  ``greedy`` limited to an eighth of the decode slots each, the flood to twice the normal
  rate; ``--no-key-limits``, the control, leaves them unlimited)
  - a flood: ten times ``--rate``, open loop, with the key ``flood``;
  - slowloris: ``--slowloris`` connections sending an endless request head a byte every
    0.2 s, reconnecting whenever the router cuts one;
  - non-readers: ``--non-readers`` streaming requests with the key ``greedy`` on sockets
    with a 4 KiB receive buffer that never read, each reopened once the router has had
    time to cut it.

A normal request is ok when it gets a 200 and its stream ends with ``[DONE]``; its TTFT
is the time to the first byte of the body. Printed: per phase, the normal requests'
availability (% ok), TTFT p50/p90/p99 and wait for a decode slot (p99, from the router's
histogram of the normal key's waits: the bound of the bucket it falls in, 5 ms the
smallest), the abuse/quiet ratios, and from the router's
``/metrics`` what became of the abusers (refusals by key, connections cut by phase).
Every answer of the fake engine is ``--tokens`` tokens of ``--token-bytes`` bytes, one
every ``--itl-ms`` ms; a non-reader asks for 2,000 tokens (megabytes), so that it fills
the buffers between it and the router and holds its slot until the router cuts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fakes.router_proc import free_port  # noqa: E402

Metrics = dict[tuple[str, tuple[Any, ...]], float]  # (name, sorted labels) -> value

KEYS = {"normal": "bench-normal-key", "flood": "bench-flood-key", "greedy": "bench-greedy-key"}
BODY = {"model": "tiny", "prompt": "hello there", "stream": True}
GREEDY_TOKENS = 2000  # a non-reader asks for a long answer: megabytes it never reads
WRITE_TIMEOUT = 3.0  # the router's connections.write_timeout here
HOLD_S = 12.0  # a non-reader keeps its socket this long: past the router's cut
# Idle connections dropped before uvicorn's 5 s keep-alive closes them under a new request
# (httpx's default expiry is those same 5 s: a race the quiet phase would count as a failure).
LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=200, keepalive_expiry=2)


@dataclass
class Phase:
    name: str
    ttft: list[float] = field(default_factory=list)
    ok: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    router_cpu: float = 0.0  # share of one core the router used during the phase
    wait_p99: float = float("nan")  # the normal key's wait for a decode slot (bucket bound)

    @property
    def total(self) -> int:
        return self.ok + sum(self.failed.values())


def _router_config(args: argparse.Namespace, d_url: str, port: int) -> dict[str, Any]:
    # Twice the normal key's rate and an eighth of the slots: the rest of a flood refused.
    flood = {"requests_per_second": 2 * args.rate, "max_concurrent": args.slots // 8}
    greedy = {"max_concurrent": args.slots // 8}
    if args.no_key_limits:  # the control: only the fair queue and the connection bounds
        flood = greedy = {}
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [
            {"name": "tiny", "mode": "aggregated", "decode": [{"url": d_url, "slots": args.slots}]}
        ],
        "auth": {
            "keys": [
                {"name": "normal", "key": KEYS["normal"]},
                {"name": "flood", "key": KEYS["flood"], "limits": flood},
                {"name": "greedy", "key": KEYS["greedy"], "limits": greedy},
            ]
        },
        "connections": {"header_timeout": 5, "body_timeout": 10, "write_timeout": WRITE_TIMEOUT},
        "admission": {"max_wait": 10},
    }


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _normal(client: httpx.AsyncClient, url: str, phase: Phase) -> None:
    started = time.monotonic()
    headers = {"authorization": f"Bearer {KEYS['normal']}"}
    try:
        async with client.stream("POST", url, json=BODY, headers=headers) as r:
            chunks = []
            async for chunk in r.aiter_bytes():
                if not chunks:
                    first = time.monotonic() - started
                chunks.append(chunk)
            text = b"".join(chunks)
        if r.status_code == 200 and text.rstrip().endswith(b"data: [DONE]"):
            phase.ok += 1
            phase.ttft.append(first)
            return
        kind = f"http {r.status_code}"
    except httpx.HTTPError as exc:
        kind = type(exc).__name__
    phase.failed[kind] = phase.failed.get(kind, 0) + 1


async def _open_loop(rate: float, until: float, seed: int, send: Any) -> None:
    """``send()`` at Poisson arrivals of ``rate`` per second until ``until``."""
    rng = random.Random(seed)
    tasks: set[asyncio.Task[None]] = set()
    while True:
        await asyncio.sleep(rng.expovariate(rate))
        if time.monotonic() >= until:
            break
        task = asyncio.create_task(send())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks, return_exceptions=True)


async def _flood(client: httpx.AsyncClient, url: str) -> None:
    headers = {"authorization": f"Bearer {KEYS['flood']}"}
    with contextlib.suppress(httpx.HTTPError):
        async with client.stream("POST", url, json=BODY, headers=headers) as r:
            async for _ in r.aiter_bytes():
                pass


async def _slowloris(host: str, port: int, until: float) -> None:
    """One connection at a time, a byte every 0.2 s of a head that never ends."""
    head = itertools.cycle(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\nx-slow: abc\r\n")
    while time.monotonic() < until:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.2)
            continue
        try:
            while time.monotonic() < until and not writer.is_closing():
                writer.write(bytes([next(head)]))
                await writer.drain()
                await asyncio.sleep(0.2)
        except OSError:
            pass  # cut by the router: connect again
        finally:
            writer.close()


async def _non_reader(host: str, port: int, until: float, hold: float) -> None:
    """A streaming request whose answer is never read, reopened every ``hold`` seconds."""
    body = json.dumps({**BODY, "max_tokens": GREEDY_TOKENS}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {KEYS['greedy']}\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    loop = asyncio.get_running_loop()
    while time.monotonic() < until:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, port))
            await loop.sock_sendall(sock, request)
            await asyncio.sleep(min(hold, max(0.0, until - time.monotonic())))
        except OSError:
            await asyncio.sleep(0.2)
        finally:
            sock.close()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _phase(
    args: argparse.Namespace,
    client: httpx.AsyncClient,
    base: str,
    name: str,
    abuse: bool,
    router_pid: int,
) -> Phase:
    phase = Phase(name)
    abusers = None
    if abuse:
        # In a process of their own: the abusers' event loop must not delay the
        # measurement of the normal requests' TTFT, only the router may.
        abusers = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--abuser-of",
            base,
            *("--seconds", str(args.seconds), "--rate", str(args.rate)),
            *("--slowloris", str(args.slowloris), "--non-readers", str(args.non_readers)),
            *("--seed", str(args.seed)),
        )
    cpu0, t0 = _cpu_seconds(router_pid), time.monotonic()
    url = base + "/v1/completions"
    until = time.monotonic() + args.seconds
    await _open_loop(args.rate, until, args.seed, lambda: _normal(client, url, phase))
    phase.router_cpu = (_cpu_seconds(router_pid) - cpu0) / (time.monotonic() - t0)
    if abusers is not None:
        await abusers.wait()
    return phase


async def _abuse(args: argparse.Namespace) -> int:
    """The abusers of one phase (``--abuser-of URL``): flood, slowloris, non-readers."""
    base = args.abuser_of
    url = base + "/v1/completions"
    until = time.monotonic() + args.seconds
    host, port = base.removeprefix("http://").split(":")
    async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
        work = [_open_loop(10 * args.rate, until, args.seed + 1, lambda: _flood(client, url))]
        work += [_slowloris(host, int(port), until) for _ in range(args.slowloris)]
        work += [_non_reader(host, int(port), until, HOLD_S) for _ in range(args.non_readers)]
        await asyncio.gather(*work)
    return 0


async def _metrics(client: httpx.AsyncClient, base: str) -> Metrics:
    text = (
        await client.get(base + "/metrics", headers={"authorization": f"Bearer {KEYS['normal']}"})
    ).text
    out: dict[tuple[str, tuple[Any, ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _sum(metrics: Metrics, name: str, **labels: str) -> float:
    return sum(
        v for (n, ls), v in metrics.items() if n == name and labels.items() <= dict(ls).items()
    )


def _wait_p99(before: Metrics, after: Metrics) -> float:
    """The normal key's 99th percentile wait for a decode slot between two scrapes: the
    upper bound of the histogram bucket it falls in (seconds)."""
    name = "pdrouter_key_queue_wait_seconds_bucket"
    buckets = sorted(
        (float(dict(ls)["le"]), v - before.get((n, ls), 0.0))
        for (n, ls), v in after.items()
        if n == name and dict(ls).get("key") == "normal"
    )
    total = buckets[-1][1] if buckets else 0.0
    for bound, count in buckets:
        if total and count >= 0.99 * total:
            return bound
    return float("nan")


def _report(args: argparse.Namespace, quiet: Phase, abuse: Phase, metrics: Metrics) -> None:
    limits = "none (--no-key-limits)" if args.no_key_limits else "flood and greedy capped"
    print(
        f"\nkey limits: {limits}; normal traffic: {args.rate:g} req/s for "
        f"{args.seconds:g} s per phase, "
        f"{args.slots} decode slots; abuse: flood {10 * args.rate:g} req/s, "
        f"{args.slowloris} slowloris, {args.non_readers} non-readers\n"
    )
    print(
        "| phase | normal requests | ok | availability | TTFT p50 (ms) | TTFT p90 (ms) "
        "| TTFT p99 (ms) | slot wait p99 (ms, at most) | router CPU | failures |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for p in (quiet, abuse):
        avail = 100.0 * p.ok / p.total if p.total else float("nan")
        fails = ", ".join(f"{k}: {v}" for k, v in sorted(p.failed.items())) or "-"
        print(
            f"| {p.name} | {p.total} | {p.ok} | {avail:.2f}% | {_pct(p.ttft, 0.5) * 1000:.0f} "
            f"| {_pct(p.ttft, 0.9) * 1000:.0f} | {_pct(p.ttft, 0.99) * 1000:.0f} "
            f"| {p.wait_p99 * 1000:g} | {100 * p.router_cpu:.0f}% | {fails} |"
        )
    q99, a99 = _pct(quiet.ttft, 0.99), _pct(abuse.ttft, 0.99)
    q_av = quiet.ok / quiet.total if quiet.total else float("nan")
    a_av = abuse.ok / abuse.total if abuse.total else float("nan")
    print(
        f"\nabuse/quiet: availability {a_av / q_av:.3f}, slot wait p99 "
        f"{abuse.wait_p99 / quiet.wait_p99:.2f}, TTFT p99 {a99 / q99:.2f}, "
        f"TTFT p50 {_pct(abuse.ttft, 0.5) / _pct(quiet.ttft, 0.5):.2f}"
    )
    print("\nthe abusers, from the router's /metrics:")
    for key in ("flood", "greedy", "normal"):
        results = {
            r: int(_sum(metrics, "pdrouter_key_requests_total", key=key, result=r))
            for r in ("admitted", "rate_limited", "concurrency_limited", "queue_share_exceeded")
        }
        print(f"  key {key}: " + ", ".join(f"{r} {n}" for r, n in results.items()))
    cuts = {
        ph: int(_sum(metrics, "pdrouter_client_timeouts_total", phase=ph))
        for ph in ("headers", "body", "write")
    }
    print("  connections cut: " + ", ".join(f"{ph} {n}" for ph, n in cuts.items()))
    print(f"  decode slots in use at the end: {_sum(metrics, 'pdrouter_decode_slots_in_use'):.0f}")


async def run(args: argparse.Namespace) -> int:
    d_port, r_port = free_port(), free_port()
    behaviour = {
        "tokens": args.tokens,
        "token_delay": args.itl_ms / 1000,
        "token_padding": args.token_bytes,
        "tokens_from_request": True,  # normal and flood ask for none: --tokens
    }
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "router.yaml"
        cfg.write_text(yaml.safe_dump(_router_config(args, f"http://127.0.0.1:{d_port}", r_port)))
        try:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "tests.fakes.run_fake",
                        str(d_port),
                        json.dumps(behaviour),
                    ],
                    cwd=ROOT,
                )
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "router", "serve", "--config", str(cfg)],
                    cwd=ROOT,
                    stderr=subprocess.DEVNULL if not args.router_log else None,
                )
            )
            base = f"http://127.0.0.1:{r_port}"
            async with httpx.AsyncClient(timeout=60, limits=LIMITS) as client:
                deadline = time.monotonic() + 60
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        if (await client.get(base + "/ready")).status_code == 200:
                            break
                    if time.monotonic() > deadline:
                        raise RuntimeError("the router did not become ready")
                    await asyncio.sleep(0.1)
                pid = procs[-1].pid
                before = await _metrics(client, base)
                quiet = await _phase(args, client, base, "quiet", False, pid)
                middle = await _metrics(client, base)
                abuse = await _phase(args, client, base, "abuse", True, pid)
                await asyncio.sleep(1.0)  # the last cuts land
                after = await _metrics(client, base)
                quiet.wait_p99 = _wait_p99(before, middle)
                abuse.wait_p99 = _wait_p99(middle, after)
                _report(args, quiet, abuse, after)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase")
    parser.add_argument("--rate", type=float, default=8.0, help="normal requests per second")
    parser.add_argument("--slots", type=int, default=32, help="decode slots")
    parser.add_argument("--slowloris", type=int, default=100)
    parser.add_argument("--non-readers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--token-bytes", type=int, default=2048)
    parser.add_argument("--itl-ms", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--router-log", action="store_true", help="show the router's log")
    parser.add_argument(
        "--no-key-limits",
        action="store_true",
        help="the control: no limits on the abusers' keys (fair queue and connection bounds only)",
    )
    parser.add_argument("--abuser-of", help=argparse.SUPPRESS)  # the abusers' own process
    args = parser.parse_args()
    raise SystemExit(asyncio.run(_abuse(args) if args.abuser_of else run(args)))


if __name__ == "__main__":
    main()
