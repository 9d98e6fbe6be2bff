"""Closed-loop load generator (a separate process): N keep-alive connections,
each sending one streaming request after another for a fixed time; or, with
``--rate``, open loop: requests arrive at a fixed rate whatever the answers do.

Raw asyncio protocol + httptools on uvloop, so the client costs a few
microseconds per SSE event; the benchmark checks its ceiling against calling D
directly. Prints one JSON document with the raw per-request samples' summary.

Requests are counted when they complete inside the measured window (whenever
they started), so a request stuck since the warm-up shows its full latency.
Per request: TTFT is the time to the first body bytes carrying an SSE event,
end-to-end the time to the end of the response, chunks the SSE events seen
(``[DONE]`` excluded). An error is a non-200 status, a connection failure, a
stream without ``[DONE]`` or with an ``"error"`` event.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast

import httptools
import orjson
import uvloop


@dataclass
class Totals:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    ok: int = 0
    errors: int = 0
    chunks: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    connect: list[float] = field(default_factory=list)
    inflight: int = 0  # requests sent and not yet complete, right now
    inflight_samples: list[int] = field(default_factory=list)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


class Client(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.done: asyncio.Future[None] | None = None
        self.lost = asyncio.get_running_loop().create_future()
        self.t0 = 0.0
        self.ttft: float | None = None
        self.events = 0
        self.saw_done = False
        self.saw_error = False
        self.tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection lost"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.done is not None and not self.done.done():
                self.done.set_exception(exc)

    def on_body(self, body: bytes) -> None:
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.t0
        # An event ends with a blank line; a seam may split it, so keep 8 bytes of tail.
        text = self.tail + body
        self.events += text.count(b"\n\n") - self.tail.count(b"\n\n")
        if b"[DONE]" in text:
            self.saw_done = True
        if b'"error"' in text:
            self.saw_error = True
        self.tail = text[-8:]

    def on_message_complete(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    async def request(self, raw: bytes) -> tuple[int, float, int, bool]:
        """Send one request; (status, ttft, events, clean end)."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self.done = loop.create_future()
        self.ttft, self.events, self.saw_done, self.saw_error, self.tail = (
            None,
            0,
            False,
            False,
            b"",
        )
        self.t0 = time.perf_counter()
        self.transport.write(raw)
        await self.done
        status = self.parser.get_status_code()
        clean = self.saw_done and not self.saw_error
        done_events = 1 if self.saw_done else 0
        return status, self.ttft or 0.0, self.events - done_events, clean


def build_request(host: str, port: int, path: str, doc: dict[str, Any]) -> bytes:
    body = orjson.dumps(doc)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"accept: text/event-stream\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _worker(
    args: argparse.Namespace,
    raw: bytes,
    totals: Totals,
    t_start: float,
    t_end: float,
    connect_gate: asyncio.Semaphore,
) -> None:
    loop = asyncio.get_running_loop()
    client: Client | None = None
    while time.perf_counter() < t_end:
        if client is None or client.lost.done():
            try:
                async with connect_gate:
                    c0 = time.perf_counter()
                    _, client = await loop.create_connection(Client, args.host, args.port)
                    totals.connect.append(time.perf_counter() - c0)
            except OSError as exc:
                totals.error(f"connect:{type(exc).__name__}")
                client = None
                await asyncio.sleep(0.05)
                continue
        t0 = time.perf_counter()
        totals.inflight += 1
        try:
            status, ttft, events, clean = await asyncio.wait_for(
                client.request(raw), args.request_timeout
            )
        except (ConnectionError, httptools.HttpParserError, TimeoutError) as exc:
            totals.inflight -= 1
            if time.perf_counter() >= t_start:
                totals.error(type(exc).__name__)
            if client.transport is not None:
                client.transport.close()
            client = None
            continue
        t1 = time.perf_counter()
        totals.inflight -= 1
        if not t_start <= t1 < t_end:
            # Counted by completion time: a request stuck since the warm-up still
            # shows its full latency when it ends inside the window.
            continue
        if status != 200 or not clean:
            totals.error(f"status:{status}" if status != 200 else "unclean_stream")
            continue
        totals.ok += 1
        totals.chunks += events
        totals.ttft.append(ttft)
        totals.e2e.append(t1 - t0)
    if client is not None and client.transport is not None:
        client.transport.close()


async def _one_open(
    args: argparse.Namespace,
    raw: bytes,
    totals: Totals,
    idle: list[Client],
    t_start: float,
    t_end: float,
) -> None:
    """One open-loop arrival: an idle keep-alive connection (or a new one), one request.
    The clock starts at the arrival, so a slow connect counts in the request's latency."""
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    totals.inflight += 1
    try:
        while idle and idle[-1].lost.done():
            idle.pop()
        client = (
            idle.pop() if idle else (await loop.create_connection(Client, args.host, args.port))[1]
        )
        status, ttft, events, clean = await asyncio.wait_for(
            client.request(raw), args.request_timeout
        )
    except (OSError, ConnectionError, httptools.HttpParserError, TimeoutError) as exc:
        totals.inflight -= 1
        if time.perf_counter() >= t_start:
            totals.error(type(exc).__name__)
        return
    t1 = time.perf_counter()
    totals.inflight -= 1
    idle.append(client)
    if not t_start <= t0 < t_end:
        return  # counted by arrival time: the offered rate is what the window measures
    if status != 200 or not clean:
        totals.error(f"status:{status}" if status != 200 else "unclean_stream")
        return
    totals.ok += 1
    totals.chunks += events
    totals.ttft.append(ttft + (client.t0 - t0))
    totals.e2e.append(t1 - t0)


async def _open_loop(
    args: argparse.Namespace, raw: bytes, totals: Totals, t_start: float, t_end: float
) -> None:
    """Open loop: requests arrive ``--rate`` per second at even intervals, whether or not the
    earlier ones are done; waits for the window's arrivals to finish."""
    idle: list[Client] = []
    tasks: set[asyncio.Task[None]] = set()
    gap = 1.0 / args.rate
    t_next = time.perf_counter()
    while t_next < t_end:
        delay = t_next - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(_one_open(args, raw, totals, idle, t_start, t_end))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        t_next += gap
    if tasks:
        await asyncio.wait(tasks)
    for client in idle:
        if client.transport is not None:
            client.transport.close()


async def _sample_inflight(totals: Totals, t_start: float, t_end: float) -> None:
    """How many streams are really open: the concurrency the target actually saw."""
    while (now := time.perf_counter()) < t_end:
        if now >= t_start:
            totals.inflight_samples.append(totals.inflight)
        await asyncio.sleep(0.05)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    prompt = "x" * args.prompt_chars
    doc: dict[str, Any] = {"model": args.model, "stream": True, "max_tokens": args.max_tokens}
    if args.chat:
        doc["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        doc["prompt"] = prompt
        path = "/v1/completions"
    raw = build_request(args.host, args.port, path, doc)
    totals = Totals()
    now = time.perf_counter()
    t_start, t_end = now + args.warmup, now + args.warmup + args.duration
    gate = asyncio.Semaphore(256)  # bounded connect storm: the listen backlog is finite
    cpu0 = os.times()
    if args.rate:
        await asyncio.gather(
            _sample_inflight(totals, t_start, t_end),
            _open_loop(args, raw, totals, t_start, t_end),
        )
    else:
        await asyncio.gather(
            _sample_inflight(totals, t_start, t_end),
            *(_worker(args, raw, totals, t_start, t_end, gate) for _ in range(args.concurrency)),
        )
    cpu1 = os.times()
    # Closed loop counts requests completed in the window; open loop those that arrived in it.
    elapsed = args.duration
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return {
        "requests": totals.ok,
        "errors": totals.errors,
        "error_kinds": totals.error_kinds,
        "rps": totals.ok / elapsed,
        "chunks_per_s": totals.chunks / elapsed,
        "ttft_p50_ms": _pct(totals.ttft, 0.50) * 1e3,
        "ttft_p95_ms": _pct(totals.ttft, 0.95) * 1e3,
        "ttft_p99_ms": _pct(totals.ttft, 0.99) * 1e3,
        "e2e_p50_ms": _pct(totals.e2e, 0.50) * 1e3,
        "e2e_p95_ms": _pct(totals.e2e, 0.95) * 1e3,
        "e2e_p99_ms": _pct(totals.e2e, 0.99) * 1e3,
        "chunks": totals.chunks,
        "inflight_avg": sum(totals.inflight_samples) / max(1, len(totals.inflight_samples)),
        "inflight_max": max(totals.inflight_samples, default=0),
        "connect_p99_ms": _pct(totals.connect, 0.99) * 1e3,
        "client_cpu_pct": 100.0 * cpu / (time.perf_counter() - now),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--model", default="fake")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompt-chars", type=int, default=512)
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="open loop: requests per second at even intervals (--concurrency ignored)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    result = uvloop.run(_main(parse_args(argv)))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    main()
