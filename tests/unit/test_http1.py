"""The engine-call HTTP/1.1 client over real loopback sockets, against a scripted raw
server: keep-alive reuse, close-to-abort, the one stale-connection retry, expiry,
malformed and truncated responses, read timeouts, back-pressure, chunk joining."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import orjson
import pytest

from router.carrier import Http1Carrier
from router.config import TimeoutConfig
from router.engines.breaker import Breaker
from router.engines.instance import Instance, Role
from router.http1 import (
    _HIGH_WATER,
    ConnectError,
    Http1Pool,
    Http1Response,
    Origin,
    ReadError,
    ReadTimeout,
    RemoteProtocolError,
    _Conn,
    split_url,
)
from router.upstream import UpstreamClient
from tests.conftest import eventually

WAIT = 10.0  # generous bound on every wait for something that should happen promptly
CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
LAST_CHUNK = b"0\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def post(body: bytes, target: str = "/v1/x?y=1") -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: engine\r\ncontent-length: %d\r\n\r\n" % (
        target.encode(),
        len(body),
    )


@dataclass
class Request:
    head: bytes
    body: bytes


class Peer:
    """One accepted connection, as the server script sees it."""

    def __init__(
        self,
        index: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        log: list[Request],
    ) -> None:
        self.index = index
        self.reader, self.writer = reader, writer
        self.eof = asyncio.Event()  # the client closed the connection
        self._log = log

    async def read_request(self) -> Request | None:
        """The next request (head, then a content-length body); None when the client closed."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.eof.set()
            return None
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        request = Request(head, await self.reader.readexactly(length))
        self._log.append(request)
        return request

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def respond(self, body: bytes = b"ok") -> None:
        await self.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    async def until_eof(self) -> None:
        """Read and drop whatever comes until the client closes the connection."""
        with contextlib.suppress(ConnectionError):
            while await self.reader.read(65536):
                pass
        self.eof.set()


Script = Callable[[Peer], Awaitable[None]]


class ScriptedServer:
    """Loopback server running ``script`` on each connection, closing it when the script returns."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.peers: list[Peer] = []
        self.requests: list[Request] = []
        self.failures: list[BaseException] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.origin = Origin("http", "127.0.0.1", 0)

    @property
    def accepted(self) -> int:
        return len(self.peers)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.origin = Origin("http", "127.0.0.1", port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        peer = Peer(len(self.peers), reader, writer, self.requests)
        self.peers.append(peer)
        try:
            await self.script(peer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception as exc:
            self.failures.append(exc)
        finally:
            writer.close()
            self._tasks.discard(task)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()
        assert not self.failures, self.failures


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Script], Awaitable[ScriptedServer]]]:
    servers: list[ScriptedServer] = []

    async def start(script: Script) -> ScriptedServer:
        server = ScriptedServer(script)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def pool() -> AsyncIterator[Http1Pool]:
    http = Http1Pool(connect_timeout=5, keepalive_expiry=30)
    yield http
    http.close()


async def echo(peer: Peer) -> None:
    """Keep-alive: answer every request with ``echo:`` and its body."""
    while (request := await peer.read_request()) is not None:
        await peer.respond(b"echo:" + request.body)


async def closed_by_client(peer: Peer) -> None:
    await asyncio.wait_for(peer.eof.wait(), WAIT)


async def ask(pool: Http1Pool, origin: Origin, body: bytes, timeout: float = WAIT) -> Http1Response:
    return await asyncio.wait_for(pool.request(origin, post(body), body, timeout), WAIT)


async def fetch(pool: Http1Pool, origin: Origin, body: bytes) -> bytes:
    """One request read to its end and closed."""
    response = await ask(pool, origin, body)
    try:
        assert response.status == 200
        data = await asyncio.wait_for(response.read_all(), WAIT)
        assert response.ended
        return data
    finally:
        response.close()


# -- keep-alive, close-to-abort, stale retry, expiry -------------------------------


async def test_sequential_requests_read_to_the_end_share_one_connection(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    server = await serve(echo)
    assert await fetch(pool, server.origin, b"first") == b"echo:first"
    assert await fetch(pool, server.origin, b"second") == b"echo:second"
    assert server.accepted == 1
    assert [r.body for r in server.requests] == [b"first", b"second"]
    head = server.requests[0].head
    assert head.startswith(b"POST /v1/x?y=1 HTTP/1.1\r\n")
    assert b"\r\nhost: engine\r\n" in head and b"\r\ncontent-length: 5\r\n" in head


async def test_upstream_client_heads_carry_target_host_auth_id_and_length(
    serve: Callable[[Script], Awaitable[ScriptedServer]],
) -> None:
    server = await serve(echo)
    client = UpstreamClient(TimeoutConfig(), Http1Carrier(WAIT, upstream_key="sekrit"))
    base = f"http://127.0.0.1:{server.origin.port}"
    try:
        engine = Instance(base, Role.DECODE, "tiny", Breaker(5, 10.0))
        stream = await client.open(engine, "/v1/completions", {"prompt": "hi"}, "req-1")
        assert await stream.read_all() == b'echo:{"prompt":"hi"}'
        stream.close()
        assert await client.get(engine, "/metrics?x=1", WAIT) == (200, b"echo:")
    finally:
        await client.aclose()
    assert server.accepted == 1
    post_head, get_head = (r.head.lower().split(b"\r\n") for r in server.requests)
    host = f"host: 127.0.0.1:{server.origin.port}".encode()
    assert post_head[0] == b"post /v1/completions http/1.1"
    assert {
        host,
        b"content-type: application/json",
        b"authorization: bearer sekrit",
        b"x-request-id: req-1",
        b"content-length: %d" % len(orjson.dumps({"prompt": "hi"})),
    } <= set(post_head)
    assert get_head[0] == b"get /metrics?x=1 http/1.1" and host in get_head


async def test_closing_a_response_before_its_end_closes_the_connection(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    async def script(peer: Peer) -> None:
        if peer.index > 0:
            return await echo(peer)
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"first"))
        await peer.until_eof()

    server = await serve(script)
    response = await ask(pool, server.origin, b"x")
    assert await asyncio.wait_for(anext(response), WAIT) == b"first"
    assert not response.ended
    response.close()
    response.close()  # idempotent
    await closed_by_client(server.peers[0])
    assert await fetch(pool, server.origin, b"y") == b"echo:y"
    assert server.accepted == 2


async def test_reused_connection_closed_unanswered_is_retried_once_on_a_fresh_one(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    async def script(peer: Peer) -> None:
        if peer.index > 0:
            return await echo(peer)
        await peer.read_request()
        await peer.respond(b"one")
        await peer.read_request()  # then close without a byte

    server = await serve(script)
    assert await fetch(pool, server.origin, b"a") == b"one"
    assert await fetch(pool, server.origin, b"b") == b"echo:b"
    assert server.accepted == 2
    assert [r.body for r in server.requests] == [b"a", b"b", b"b"]


async def test_fresh_connection_closed_unanswered_is_not_retried(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()  # then close without a byte

    server = await serve(script)
    with pytest.raises(RemoteProtocolError):
        await ask(pool, server.origin, b"a")
    assert server.accepted == 1


async def test_stale_retry_happens_once_only(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        if peer.index == 0:
            await peer.respond(b"one")
            await peer.read_request()
        # then close without a byte, on the reused connection and on the fresh one

    server = await serve(script)
    assert await fetch(pool, server.origin, b"a") == b"one"
    with pytest.raises(RemoteProtocolError):
        await ask(pool, server.origin, b"b")
    assert server.accepted == 2


async def test_idle_connection_older_than_keepalive_expiry_is_replaced(
    serve: Callable[[Script], Awaitable[ScriptedServer]],
) -> None:
    now = [1000.0]
    pool = Http1Pool(connect_timeout=5, keepalive_expiry=4, clock=lambda: now[0])
    server = await serve(echo)
    try:
        await fetch(pool, server.origin, b"a")
        now[0] += 3.9
        await fetch(pool, server.origin, b"b")
        assert server.accepted == 1
        now[0] += 4.1
        assert await fetch(pool, server.origin, b"c") == b"echo:c"
        assert server.accepted == 2
        await closed_by_client(server.peers[0])
    finally:
        pool.close()


async def test_idle_connection_closed_by_the_server_leaves_the_pool(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    given_back = asyncio.Event()

    async def script(peer: Peer) -> None:
        if peer.index > 0:
            return await echo(peer)
        await peer.read_request()
        await peer.respond(b"one")
        await given_back.wait()  # then close the idle connection

    server = await serve(script)
    assert await fetch(pool, server.origin, b"a") == b"one"
    assert pool._idle[server.origin]
    given_back.set()
    await eventually(lambda: not pool._idle[server.origin], WAIT)
    assert await fetch(pool, server.origin, b"b") == b"echo:b"
    assert server.accepted == 2
    assert [r.body for r in server.requests] == [b"a", b"b"]


async def test_pool_close_closes_idle_connections(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    server = await serve(echo)
    await fetch(pool, server.origin, b"a")
    assert not server.peers[0].eof.is_set()
    pool.close()
    await closed_by_client(server.peers[0])


async def test_closing_a_response_another_task_is_reading_ends_that_read(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"first"))
        await peer.until_eof()

    server = await serve(script)
    response = await ask(pool, server.origin, b"a")  # read timeout: WAIT
    assert await asyncio.wait_for(anext(response), WAIT) == b"first"
    reader = asyncio.create_task(anext(response))
    await eventually(lambda: response._waiter is not None)  # the reader waits for bytes
    assert not reader.done()
    response.close()  # e.g. the P leg failed while D streams: end D's relay now
    with pytest.raises(ReadError):
        await asyncio.wait_for(reader, WAIT / 2)
    await closed_by_client(server.peers[0])


async def test_response_read_to_its_end_after_pool_close_closes_its_connection(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    server = await serve(echo)
    response = await ask(pool, server.origin, b"a")
    pool.close()
    assert await asyncio.wait_for(response.read_all(), WAIT) == b"echo:a"
    response.close()
    await closed_by_client(server.peers[0])


# -- malformed, truncated and until-EOF responses ---------------------------------


async def test_malformed_response_raises_remote_protocol_error_and_closes(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"NOT-HTTP garbage\r\n\r\n")
        await peer.until_eof()

    server = await serve(script)
    with pytest.raises(RemoteProtocolError, match="malformed"):
        await ask(pool, server.origin, b"a")
    await closed_by_client(server.peers[0])


async def test_connection_dropped_mid_chunked_body_raises_when_iterating(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD + chunk(b"part"))  # then close mid-body

    server = await serve(script)
    response = await ask(pool, server.origin, b"a")
    received: list[bytes] = []
    with pytest.raises(RemoteProtocolError):
        async with asyncio.timeout(WAIT):
            async for data in response:
                received.append(data)
    assert received == [b"part"]
    assert not response.ended
    response.close()


async def test_body_without_length_or_chunking_ends_at_eof(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nabc")
        await asyncio.sleep(0.05)
        await peer.send(b"def")  # then close: the end of the body

    server = await serve(script)
    response = await ask(pool, server.origin, b"a")
    assert response.content_type == "text/plain"
    assert await asyncio.wait_for(response.read_all(), WAIT) == b"abcdef"
    assert response.ended
    response.close()
    assert await fetch(pool, server.origin, b"b") == b"abcdef"
    assert server.accepted == 2


# -- timeouts and refusals -------------------------------------------------------


async def test_stall_after_headers_raises_read_timeout_when_iterating(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n")
        await peer.until_eof()

    server = await serve(script)
    response = await ask(pool, server.origin, b"a", timeout=0.2)
    started = time.monotonic()
    with pytest.raises(ReadTimeout):
        await asyncio.wait_for(anext(response), WAIT)
    assert 0.1 <= time.monotonic() - started < WAIT / 2
    response.close()
    await closed_by_client(server.peers[0])


async def test_read_timeout_counts_from_the_last_bytes_not_the_first_wait(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(12):  # at least 0.6 s of body, gaps far below the 0.4 s timeout
            await asyncio.sleep(0.05)
            await peer.send(b"1\r\nx\r\n")
        await peer.until_eof()

    server = await serve(script)
    response = await ask(pool, server.origin, b"a", timeout=0.4)
    got = b""
    with pytest.raises(ReadTimeout):
        for _ in range(100):  # the 12 bytes (perhaps fewer reads), then the stall
            got += await asyncio.wait_for(anext(response), WAIT)
    assert got == b"x" * 12  # every byte arrived before the stall timed out
    response.close()
    assert response._timer is None  # closing cancels the read timer
    await closed_by_client(server.peers[0])


async def test_no_headers_raises_read_timeout_from_request(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.until_eof()

    server = await serve(script)
    started = time.monotonic()
    with pytest.raises(ReadTimeout):
        await ask(pool, server.origin, b"a", timeout=0.2)
    assert 0.1 <= time.monotonic() - started < WAIT / 2
    await closed_by_client(server.peers[0])


async def test_connection_refused_raises_connect_error(pool: Http1Pool) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
        await ask(pool, Origin("http", "127.0.0.1", port), b"a")


# -- back-pressure and chunk joining ----------------------------------------------


async def test_unread_body_is_bounded_and_arrives_intact(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    payload = os.urandom(8 * 1024 * 1024)

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(payload) + payload)
        await echo(peer)

    server = await serve(script)
    response = await ask(pool, server.origin, b"a")
    transport = response._conn.transport
    await eventually(lambda: response._buffered > _HIGH_WATER)
    # Past the high-water mark the socket is no longer read: nothing more can be buffered.
    assert not transport.is_reading()
    assert response._buffered < _HIGH_WATER + 512 * 1024
    assert await asyncio.wait_for(response.read_all(), WAIT) == payload
    assert response.ended
    response.close()
    assert await fetch(pool, server.origin, b"b") == b"echo:b"  # back in the pool, usable
    assert server.accepted == 1


async def test_chunks_that_arrived_together_are_joined_and_ended_waits_for_the_end(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    more, last = asyncio.Event(), asyncio.Event()

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD)
        await more.wait()
        await peer.send(chunk(b"ab") + chunk(b"cd"))
        await last.wait()
        await peer.send(chunk(b"ef") + LAST_CHUNK)
        await echo(peer)

    server = await serve(script)
    response = await ask(pool, server.origin, b"a")
    assert response.content_type == "text/event-stream" and not response.ended
    more.set()
    await eventually(lambda: response._buffered == 4, WAIT)
    assert await asyncio.wait_for(anext(response), WAIT) == b"abcd"
    assert not response.ended
    last.set()
    await eventually(lambda: response._complete, WAIT)
    assert not response.ended  # b"ef" not handed out yet
    assert await asyncio.wait_for(anext(response), WAIT) == b"ef"
    assert response.ended
    with pytest.raises(StopAsyncIteration):
        await anext(response)
    response.close()
    assert await fetch(pool, server.origin, b"b") == b"echo:b"
    assert server.accepted == 1


# -- URLs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "origin", "target", "netloc"),
    [
        ("http://h:8000/v1/x?y=1&z", Origin("http", "h", 8000), "/v1/x?y=1&z", "h:8000"),
        ("http://h", Origin("http", "h", 80), "/", "h"),
        ("http://h:80/a", Origin("http", "h", 80), "/a", "h"),
        ("https://h/a", Origin("https", "h", 443), "/a", "h"),
        ("https://h:8443/", Origin("https", "h", 8443), "/", "h:8443"),
        ("https://h:80/", Origin("https", "h", 80), "/", "h:80"),
        ("http://[::1]:8000/m?q", Origin("http", "::1", 8000), "/m?q", "[::1]:8000"),
        ("http://[::1]/", Origin("http", "::1", 80), "/", "[::1]"),
    ],
)
def test_split_url(url: str, origin: Origin, target: str, netloc: str) -> None:
    assert split_url(url) == (origin, target)
    assert origin.netloc == netloc


@pytest.mark.parametrize("url", ["ftp://h/x", "h:8000/x", "http:///x", ""])
def test_split_url_rejects_non_http_urls(url: str) -> None:
    with pytest.raises(ValueError, match="not an http"):
        split_url(url)


# -- memory ------------------------------------------------------------------------


def live(kind: type) -> int:
    """Instances the collector tracks, unreachable ones included (it is disabled here)."""
    return sum(1 for o in gc.get_objects() if type(o) is kind)


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def test_finished_and_failed_exchanges_are_freed_without_the_collector(
    serve: Callable[[Script], Awaitable[ScriptedServer]], collector_off: None
) -> None:
    """Connections, responses and their errors are freed by reference counting alone.

    A cycle (connection and parser, connection and transport, a stored error raised with
    the reader's frames, a cancelled waiter) waits for the collector instead: under load,
    for the oldest generation, minutes, and the router's memory grows meanwhile."""

    async def script(peer: Peer) -> None:
        await peer.read_request()
        if peer.index == 0:
            await peer.respond(b"done")  # then the pool closes it
        elif peer.index == 1:
            await peer.send(CHUNKED_HEAD + chunk(b"part"))  # dropped mid-body
        else:
            await peer.until_eof()  # no answer: read timeout (2), cancelled (3)

    server = await serve(script)
    pool = Http1Pool(connect_timeout=5, keepalive_expiry=30)
    conns, responses = live(_Conn), live(Http1Response)
    assert await fetch(pool, server.origin, b"a") == b"done"
    pool.close()
    response = await ask(pool, server.origin, b"b")
    with pytest.raises(RemoteProtocolError):
        async with asyncio.timeout(WAIT):
            async for _ in response:
                pass
    response.close()
    del response
    with pytest.raises(ReadTimeout):
        await pool.request(server.origin, post(b"c"), b"c", 0.05)
    waiting = asyncio.create_task(pool.request(server.origin, post(b"d"), b"d", WAIT))
    await eventually(lambda: server.accepted == 4, WAIT)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    del waiting
    for peer in server.peers[2:]:  # the others the server closed itself
        await closed_by_client(peer)
    await eventually(lambda: live(_Conn) == conns and live(Http1Response) == responses, WAIT)


# -- splice ----------------------------------------------------------------------------


async def test_a_splice_takes_chunks_as_they_arrive_and_a_refused_one_is_read_in_order(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    """While the reader waits with nothing buffered, each chunk goes to the sink; the first
    it refuses, or that comes while no reader waits, and the next ones until the splice is
    asked for again, are read, in order."""
    sends: asyncio.Queue[bytes] = asyncio.Queue()

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD)
        while (data := await sends.get()) != LAST_CHUNK:
            await peer.send(data)
        await peer.send(LAST_CHUNK)
        await echo(peer)

    server = await serve(script)
    response = await ask(pool, server.origin, b"a")
    taken: list[bytes] = []

    def sink(data: bytes) -> bool:
        if data.startswith(b"no"):
            return False
        taken.append(data)
        return True

    assert response.splice(sink)
    read = asyncio.create_task(anext(response))
    for n, data in enumerate((b"a", b"b"), 1):
        await sends.put(chunk(data))
        await eventually(lambda n=n: len(taken) == n, WAIT)  # type: ignore[misc]
    assert not read.done()  # taken chunks do not wake the reader
    await sends.put(chunk(b"no") + chunk(b"c"))  # refused, and the one after it is read too
    got = await asyncio.wait_for(read, WAIT)
    while len(got) < 3:  # in one read or two, as the bytes came
        got += await asyncio.wait_for(anext(response), WAIT)
    assert got == b"noc" and taken == [b"a", b"b"]
    await sends.put(chunk(b"d"))  # the splice ended with the refusal: read
    assert await asyncio.wait_for(anext(response), WAIT) == b"d"
    assert response.splice(sink)
    await sends.put(chunk(b"dd"))  # no reader waits: read (it would overtake the reader's)
    await eventually(lambda: response._buffered == 2, WAIT)
    assert await asyncio.wait_for(anext(response), WAIT) == b"dd" and len(taken) == 2
    assert response.splice(sink)
    read = asyncio.create_task(anext(response))
    await sends.put(chunk(b"e"))
    await eventually(lambda: taken == [b"a", b"b", b"e"], WAIT)
    await sends.put(LAST_CHUNK)
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(read, WAIT)
    assert response.ended
    response.close()
    assert response._sink is None  # closing drops the sink (and what it holds)
    assert await fetch(pool, server.origin, b"b") == b"echo:b"
    assert server.accepted == 1


async def test_spliced_chunks_move_the_read_timeout_as_reads_do(
    serve: Callable[[Script], Awaitable[ScriptedServer]], pool: Http1Pool
) -> None:
    """Chunks the sink takes are bytes from the engine: a stream that keeps sending them
    for longer than the read timeout does not time out; its stall afterwards does."""

    async def script(peer: Peer) -> None:
        await peer.read_request()
        await peer.send(CHUNKED_HEAD)
        for _ in range(5):  # 2 s of body, gaps of 0.4 s, well below the 1 s timeout
            await asyncio.sleep(0.4)
            await peer.send(chunk(b"x"))
        await peer.until_eof()

    server = await serve(script)
    response = await ask(pool, server.origin, b"a", timeout=1.0)
    taken: list[bytes] = []
    assert response.splice(lambda data: taken.append(data) is None)
    started = time.monotonic()
    with pytest.raises(ReadTimeout):
        await asyncio.wait_for(anext(response), WAIT)
    assert taken == [b"x"] * 5  # all of them came before the stall timed out
    assert time.monotonic() - started >= 2.0
    response.close()
    await closed_by_client(server.peers[0])
