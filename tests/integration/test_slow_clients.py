"""Slow and greedy clients against the router served as ``pd-router serve`` serves it (its
guarded httptools protocol), on raw sockets: each is cut within its configured bound, with a
metric and a log line, and holds no slot or engine leg afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.server import ServerState

from router.app import create_app
from router.config import ConnectionsConfig, parse_config
from router.guard import ClientEvents, guarded_protocol
from router.metrics import Metrics
from router.relay import CONNECTION
from tests.conftest import Cluster, client_leaves, eventually, metric
from tests.fakes.servers import serve

BOUND_S = 0.5  # each timeout under test
SLACK_S = 5.0  # how much later than its bound a cut may come on a loaded machine


async def _router(
    cluster: Cluster, mode: str = "aggregated", **connections: Any
) -> tuple[str, Any]:
    limits = {"header_timeout": BOUND_S, "body_timeout": BOUND_S, "write_timeout": BOUND_S}
    cfg = cluster.config(mode, connections={**limits, **connections})
    app = create_app(parse_config(cfg), health_checks=False)
    url = await cluster.stack.enter_async_context(serve(app, http=app.http_protocol))
    ctx = app.state.ctx
    cluster.routers.append(ctx)
    return url, ctx


@contextlib.asynccontextmanager
async def _connect(
    url: str, rcvbuf: int | None = None
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connecting: the window the router may fill
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _trickle(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes, deadline: float
) -> tuple[bytes, float]:
    """Send ``data`` (then more header bytes) a byte at a time until the router answers
    and closes; returns its answer and when the connection ended."""
    answer = b""
    for byte in itertools.chain(data, itertools.cycle(b"x-slow: abcdefgh\r\n")):
        assert time.monotonic() < deadline, "the router never cut the connection"
        with contextlib.suppress(OSError):
            writer.write(bytes([byte]))
            await writer.drain()
        try:
            chunk = await asyncio.wait_for(reader.read(65536), 0.05)
        except TimeoutError:
            continue
        except OSError:
            return answer, time.monotonic()
        if not chunk:
            return answer, time.monotonic()
        answer += chunk
    raise AssertionError("unreachable")


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def test_a_head_sent_a_byte_at_a_time_is_cut_at_its_bound(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    url, ctx = await _router(cluster)
    async with _connect(url) as (reader, writer):
        started = time.monotonic()
        head = b"POST /v1/completions HTTP/1.1\r\nhost: r\r\n"
        answer, ended = await _trickle(reader, writer, head, started + BOUND_S + SLACK_S)
    assert _status(answer) == 408 and b'"code":"request_timeout"' in answer
    assert BOUND_S <= ended - started <= BOUND_S + SLACK_S
    assert metric(ctx, "pdrouter_client_timeouts_total", phase="headers") == 1
    assert "event=client_timeout phase=headers" in caplog.text
    assert all(e.received == [] for e in cluster.engines)
    await eventually(lambda: metric(ctx, "pdrouter_client_connections") == 0)


async def test_a_connection_that_sends_nothing_is_cut_at_its_bound(cluster: Cluster) -> None:
    url, ctx = await _router(cluster)
    async with _connect(url) as (reader, _):
        started = time.monotonic()
        answer = await asyncio.wait_for(reader.read(), BOUND_S + SLACK_S)
        ended = time.monotonic()
    assert _status(answer) == 408
    assert BOUND_S <= ended - started <= BOUND_S + SLACK_S
    assert metric(ctx, "pdrouter_client_timeouts_total", phase="headers") == 1


async def test_client_sockets_get_the_configured_send_buffer() -> None:
    """What bounds the bytes a non-reader may leave unread: the kernel's own buffer grows to
    megabytes (and Linux reports twice the size asked for)."""
    wanted = 200_000
    metrics = Metrics()
    protocol = guarded_protocol(ConnectionsConfig(send_buffer_bytes=wanted), ClientEvents(metrics))

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("no request is sent")

    config = uvicorn.Config(app, lifespan="off", log_level="critical")
    config.load()
    state = ServerState()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: protocol(config=config, server_state=state, app_state={}), "127.0.0.1", 0
    )
    port = server.sockets[0].getsockname()[1]
    try:
        async with _connect(f"http://127.0.0.1:{port}"):
            await eventually(lambda: len(state.connections) == 1)
            (conn,) = state.connections
            sock = conn.transport.get_extra_info("socket")
            # Linux doubles what was asked (socket(7)), up to twice net.core.wmem_max.
            cap = int(Path("/proc/sys/net/core/wmem_max").read_text())
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * min(wanted, cap)
    finally:
        server.close()
        await server.wait_closed()


class _Writes:
    """The response's real transport, with the writes made on it recorded."""

    def __init__(self, transport: Any) -> None:
        self.transport, self.writes = transport, list[bytes]()

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        self.transport.write(data)

    def close(self) -> None:
        self.transport.close()

    def is_closing(self) -> bool:
        return bool(self.transport.is_closing())


@pytest.mark.parametrize("more", [True, False], ids=["streamed", "whole"])
async def test_a_held_head_goes_out_with_the_first_body_write(more: bool) -> None:
    """The relay's hold_head() on the guarded protocol: the head and the body message sent
    after it leave in one write; the rest of a streamed answer as before."""
    metrics = Metrics()
    protocol = guarded_protocol(ConnectionsConfig(), ClientEvents(metrics))
    recorded: list[_Writes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        conn = scope[CONNECTION]
        writes = _Writes(conn.cycle.transport)
        conn.cycle.transport = writes
        recorded.append(writes)
        conn.hold_head()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": more})
        if more:
            await send({"type": "http.response.body", "body": b"-rest", "more_body": False})

    config = uvicorn.Config(app, lifespan="off", log_level="critical")
    config.load()
    loop = asyncio.get_running_loop()
    state = ServerState()
    server = await loop.create_server(
        lambda: protocol(config=config, server_state=state, app_state={}), "127.0.0.1", 0
    )
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient() as client:
            answer = await client.get(f"http://127.0.0.1:{port}/")
    finally:
        server.close()
        await server.wait_closed()
    assert answer.status_code == 200
    assert answer.content == (b"first-rest" if more else b"first")
    (writes,) = recorded
    head, *rest = writes.writes
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\n\r\n5\r\nfirst\r\n" in head
    assert len(rest) == (1 if more else 0)  # the rest of the stream: a write of its own


async def test_a_body_sent_a_byte_at_a_time_is_cut_before_any_slot(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    url, ctx = await _router(cluster)
    body = json.dumps({"model": "tiny", "prompt": "hi " * 50}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: {len(body)}\r\n\r\n"
    async with _connect(url) as (reader, writer):
        writer.write(head.encode())
        await writer.drain()
        started = time.monotonic()
        answer, ended = await _trickle(reader, writer, body, started + BOUND_S + SLACK_S)
    assert _status(answer) == 408
    assert BOUND_S <= ended - started <= BOUND_S + SLACK_S
    assert metric(ctx, "pdrouter_client_timeouts_total", phase="body") == 1
    assert "event=client_timeout phase=body" in caplog.text
    assert metric(ctx, "pdrouter_disagg_decisions_total") == 0  # never reached a slot
    assert all(e.received == [] for e in cluster.engines)


async def _answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
    """One response (a content-length or chunked): its status and JSON body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), SLACK_S)
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:] if line)
    if b"content-length" in fields:
        body = await reader.readexactly(int(fields[b"content-length"]))
        return _status(head), json.loads(body)
    body = b""
    while size := int(await asyncio.wait_for(reader.readline(), SLACK_S), 16):
        body += await reader.readexactly(size)
        await reader.readline()
    await reader.readline()
    return _status(head), json.loads(body)


async def test_a_body_that_came_whole_is_taken_and_the_connection_reads_on(
    cluster: Cluster,
) -> None:
    """A body that arrived with its head is taken without waiting (router/guard.py
    whole_body): as the client sent it, and, past uvicorn's high-water mark (64 KiB), where
    the protocol stopped reading, reading resumed: the next request on the connection is
    read and answered."""
    url, _ctx = await _router(cluster)
    filler = "x" * 100_000
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, "user": filler})
    head = f"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: {len(body)}\r\n\r\n"
    async with _connect(url) as (reader, writer):
        for _ in range(2):
            writer.write(head.encode() + body.encode())
            await writer.drain()
            status, answer = await _answer(reader)
            assert status == 200 and answer["choices"][0]["text"]
    received = [r for e in cluster.engines for r in e.received]
    assert len(received) == 2 and all(r.body["user"] == filler for r in received)


async def test_a_body_nobody_reads_cannot_keep_its_connection(cluster: Cluster) -> None:
    """Answered at once (405: nothing reads the body), the body still trickling in: every
    byte would keep the connection alive, but its deadline ends it."""
    url, ctx = await _router(cluster)
    head = "POST /v1/models HTTP/1.1\r\nhost: r\r\ncontent-length: 100000\r\n\r\n"
    async with _connect(url) as (reader, writer):
        writer.write(head.encode())
        await writer.drain()
        started = time.monotonic()
        answer, ended = await _trickle(reader, writer, b"{", started + BOUND_S + SLACK_S)
    assert _status(answer) == 405
    assert BOUND_S <= ended - started <= BOUND_S + SLACK_S
    assert metric(ctx, "pdrouter_client_timeouts_total", phase="body") == 1


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ("".join(f"x-h{i}: v\r\n" for i in range(40)), "count"),
        (f"x-big: {'v' * 8000}\r\n", "size"),
    ],
)
async def test_too_many_or_too_large_headers_are_refused(
    cluster: Cluster, caplog: pytest.LogCaptureFixture, extra: str, reason: str
) -> None:
    url, ctx = await _router(cluster, max_headers=20, max_header_bytes=4096)
    head = f"GET /health HTTP/1.1\r\nhost: r\r\n{extra}\r\n".encode()
    async with _connect(url) as (reader, writer):
        writer.write(head)
        with contextlib.suppress(OSError):
            await writer.drain()
        answer = await asyncio.wait_for(reader.read(), BOUND_S + SLACK_S)
    assert _status(answer) == 431 and b"headers_too_large" in answer
    assert metric(ctx, "pdrouter_client_headers_refused_total", reason=reason) == 1
    assert f"event=headers_refused reason={reason}" in caplog.text
    async with httpx.AsyncClient() as client:  # a reasonable head still gets in
        assert (await client.get(url + "/health")).status_code == 200


async def test_a_head_past_its_bound_is_refused_though_a_body_comes_with_it(
    cluster: Cluster,
) -> None:
    """Only the head counts against ``max_header_bytes``: a small head and a body far past
    the bound in one read are answered (the test above this one), a large head is refused
    even when its body comes in the same read."""
    url, ctx = await _router(cluster, max_header_bytes=4096)
    body = json.dumps({"model": "tiny", "prompt": "hi", "user": "x" * 20_000}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: r\r\nx-big: {'v' * 8000}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    async with _connect(url) as (reader, writer):
        writer.write(head.encode() + body)
        with contextlib.suppress(OSError):
            await writer.drain()
        answer = await asyncio.wait_for(reader.read(), BOUND_S + SLACK_S)
    assert _status(answer) == 431
    assert metric(ctx, "pdrouter_client_headers_refused_total", reason="size") == 1
    async with httpx.AsyncClient() as client:  # the same body under a small head gets in
        r = await client.post(url + "/v1/completions", content=body)
        assert r.status_code == 200, r.text


async def test_connections_beyond_the_cap_are_closed_at_once(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    url, ctx = await _router(cluster, max_open=2, header_timeout=60)
    async with _connect(url), _connect(url):
        await eventually(lambda: metric(ctx, "pdrouter_client_connections") == 2)
        async with _connect(url) as (reader, _):
            assert await asyncio.wait_for(reader.read(), SLACK_S) == b""  # closed unread
        assert metric(ctx, "pdrouter_connections_refused_total") == 0  # not its name
        assert metric(ctx, "pdrouter_client_connections_refused_total") == 1
        assert "event=connection_refused open=2 limit=2" in caplog.text
    await eventually(lambda: metric(ctx, "pdrouter_client_connections") == 0)
    async with httpx.AsyncClient() as client:
        r = await client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert r.status_code == 200


async def test_a_client_that_stops_reading_a_stream_gives_its_slot_back(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    d = cluster.decode[0].behaviour
    d.tokens, d.token_padding = 4000, 4096  # 16 MB: far more than any buffer between us
    url, ctx = await _router(cluster)
    body = json.dumps({"model": "tiny", "prompt": "hi", "stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: {len(body)}\r\n\r\n"
    async with _connect(url, rcvbuf=4096) as (_, writer):
        writer.write(head.encode() + body)
        await writer.drain()
        await eventually(lambda: cluster.decode[0].active == 1)
        await eventually(
            lambda: metric(ctx, "pdrouter_client_timeouts_total", phase="write") == 1,
            timeout=BOUND_S + 2 * SLACK_S,
        )
        # Cut while the client still holds its socket: slot, D's leg and connection freed.
        await eventually(lambda: ctx.registry.slots_in_use() == 0)
        await eventually(lambda: cluster.decode[0].active == 0)
        await eventually(lambda: metric(ctx, "pdrouter_client_connections") == 0)
    assert "event=client_timeout phase=write" in caplog.text
    streaming = metric(ctx, "pdrouter_client_disconnects_total", phase="streaming")
    assert streaming == 1


# -- clients that leave: the guarded protocol tells the relay itself (no watcher task) ----


async def test_a_client_gone_before_the_first_byte_ends_both_legs(cluster: Cluster) -> None:
    cluster.prefill[0].behaviour.hang = True
    url, ctx = await _router(cluster, "pull")
    body = {"model": "tiny", "prompt": "hi", "stream": True}
    await client_leaves(url + "/v1/completions", body, lambda: bool(cluster.prefill[0].received))
    await eventually(lambda: cluster.prefill[0].received[0].closed_by_client)
    await eventually(
        lambda: metric(ctx, "pdrouter_client_disconnects_total", phase="before_first_byte") == 1
    )
    assert cluster.decode[0].received == []
    await eventually(lambda: ctx.registry.slots_in_use() == 0)


async def test_a_client_gone_mid_stream_ends_the_decode_leg(cluster: Cluster) -> None:
    d = cluster.decode[0].behaviour
    d.tokens, d.token_delay = 1000, 0.01
    url, ctx = await _router(cluster, "pull")
    body = {"model": "tiny", "prompt": "hi", "stream": True}
    await client_leaves(url + "/v1/completions", body)  # once the first bytes came
    await eventually(lambda: cluster.decode[0].received[0].closed_by_client)
    await eventually(
        lambda: metric(ctx, "pdrouter_client_disconnects_total", phase="streaming") == 1
    )
    await eventually(lambda: ctx.registry.slots_in_use() == 0)
