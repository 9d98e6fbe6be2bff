"""The HTTP/1.1 client for engine calls: an asyncio protocol, httptools, a keep-alive pool.

Why not httpx: its default transport (httpcore on anyio) costs the router several times
its CPU per request on the router benchmark (``bench/router_bench.py --targets
pull,pull+httpx``; figures in docs/bench-router.md): request/response object layers, a
connection pool scanned on every request and release, async-iterator layers per chunk.
Engine calls use a sliver of HTTP: a POST of a JSON body with headers the router builds
itself, a GET of ``/health`` or ``/metrics``, a response read whole or chunk by chunk.
This module does exactly that; httptools (the parser uvicorn uses) parses.

Contract:

* :meth:`Http1Pool.request` returns an :class:`Http1Response` once the status
  line and headers are in; its body is then read with ``async for`` or
  :meth:`Http1Response.read_all`.
* Failures are this module's :class:`Http1Error` classes (``ConnectError``,
  ``ConnectTimeout``, ``ReadTimeout``, ``ReadError``, ``RemoteProtocolError``, named as
  httpx names them), each raised as what the caller's ``errors`` function makes of it
  (:mod:`router.upstream` gives one that turns them into the router's errors; without
  one they are raised as they are). The raised error's ``__cause__`` is the original.
* ``read_timeout`` bounds every wait for bytes (headers, then each body read).
* Closing a response before its end closes the connection: that is how vLLM
  learns to abort the request. A response read to its end gives its keep-alive
  connection back to the pool; idle connections older than ``keepalive_expiry``
  are dropped when met (keep it below the engines' keep-alive timeout, 5 s for
  vLLM's uvicorn, so the router never writes into a connection being closed).
* A reused connection the server closed before answering a single byte is
  retried once on a fresh connection (the request never reached the server's
  application); nothing else is retried here.
* The pool has no connection cap: decode slots and admission bound how many
  engine calls run at once.
* :meth:`Http1Response.splice`: while its reader waits with nothing buffered, each body
  chunk is offered to a sink as it arrives, in the connection's callback, before any task
  wakes; the first chunk the sink refuses (or that comes while the reader is not waiting),
  and every chunk after it, are read as usual, in order: the splice ends there until it is
  asked for again. A spliced chunk moves the read timeout's deadline as a read does.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from typing import Final, NamedTuple, NoReturn, cast
from urllib.parse import urlsplit

import httptools

__all__ = [
    "ConnectError",
    "ConnectTimeout",
    "Errors",
    "Http1Error",
    "Http1Pool",
    "Http1Response",
    "Http1Timeout",
    "Origin",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "Sink",
    "split_url",
]


class Http1Error(Exception):
    """An engine call that failed in transport (never an HTTP status: that is an answer)."""


class Http1Timeout(Http1Error):
    """No connection, or no bytes, within the time allowed."""


class ConnectError(Http1Error):
    """No connection could be made: nothing listens there, or it refused."""


class ConnectTimeout(Http1Timeout):
    pass


class ReadTimeout(Http1Timeout):
    pass


class ReadError(Http1Error):
    """The connection broke (or was closed by this side) before the response's end."""


class RemoteProtocolError(Http1Error):
    """The engine closed the connection early or sent what is not HTTP/1.1."""


# What a caller makes of a failure: the exception raised in its place.
Errors = Callable[[Http1Error], BaseException]
# What takes a body chunk as it arrives (Http1Response.splice): True, taken; False, refused.
Sink = Callable[[bytes], bool]


def _as_is(error: Http1Error) -> BaseException:
    return error


def _raise(errors: Errors, error: Http1Error) -> NoReturn:
    """Raise what ``errors`` makes of ``error``, caused by it (unless it is ``error``: an
    error that is its own cause is a cycle only the collector frees)."""
    raised = errors(error)
    try:
        if raised is error:
            raise error
        raise raised from error
    finally:
        del raised, error  # this frame is in the traceback: no locals that hold it


# Unread body bytes above this pause reading from the socket (back-pressure to the engine).
_HIGH_WATER: Final = 256 * 1024


class Origin(NamedTuple):
    scheme: str
    host: str
    port: int

    @property
    def netloc(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


def split_url(url: str) -> tuple[Origin, str]:
    """``"http://h:8000/v1/x?y"`` -> ``(Origin("http", "h", 8000), "/v1/x?y")``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return Origin(parts.scheme, parts.hostname, port), target


class _StaleConnection(Exception):
    """A reused connection was closed by the server before any response byte."""


class Http1Response:
    """One response: status and content type once headers are in, then the body.

    Iterating yields whatever body bytes have arrived since the last read (chunks
    that arrived together are joined: fewer, larger writes downstream).
    """

    __slots__ = (
        "_buffered",
        "_chunks",
        "_closed",
        "_complete",
        "_conn",
        "_deadline",
        "_error",
        "_errors",
        "_headers_in",
        "_keep_alive",
        "_loop",
        "_read_timeout",
        "_sink",
        "_timer",
        "_until_eof",
        "_waiter",
        "content_type",
        "status",
    )

    def __init__(
        self,
        conn: _Conn,
        loop: asyncio.AbstractEventLoop,
        read_timeout: float | None,
        errors: Errors = _as_is,
    ) -> None:
        self.status = 0
        self.content_type = "application/json"
        self._conn = conn
        self._loop = loop
        self._read_timeout = read_timeout
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._headers_in = False
        self._complete = False
        self._error: Http1Error | None = None
        self._errors = errors
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._closed = False
        self._keep_alive = False
        self._until_eof = True  # no Content-Length and no chunked coding: the body ends at EOF
        self._sink: Sink | None = None  # splice(): offered each body chunk as it arrives

    # -- fed by the connection -------------------------------------------------

    def _on_headers(self, status: int, keep_alive: bool) -> None:
        self.status = status
        self._keep_alive = keep_alive
        self._headers_in = True
        self._wake()

    def _on_complete(self) -> None:
        self._complete = True
        self._wake()

    def _on_lost(self, exc: Exception | None) -> None:
        if self._complete:
            return
        if exc is None and self._headers_in and self._until_eof:
            self._on_complete()
            return
        if self._error is None:
            if exc is None:
                self._error = RemoteProtocolError("the engine closed the connection")
            else:
                self._error = ReadError(f"{type(exc).__name__}: {exc}")
        self._wake()

    def _on_malformed(self, message: str) -> None:
        if self._error is None:
            self._error = RemoteProtocolError(f"malformed response from the engine: {message}")
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- read by the caller ----------------------------------------------------

    def _arm(self) -> asyncio.Future[None]:
        """The future the next wait awaits (set by :meth:`_wake` or the read timeout).
        Not a coroutine; :meth:`__anext__`, the per-read wait, has the same lines inline."""
        waiter = self._waiter = self._loop.create_future()
        if self._read_timeout is not None:
            # One timer per response, not per wait (a timer per streamed chunk was a
            # visible cost): each wait only moves the deadline; the timer re-arms
            # itself when it fires early, and close() cancels it.
            self._deadline = self._loop.time() + self._read_timeout
            if self._timer is None:
                self._timer = self._loop.call_at(self._deadline, self._on_timer)
        return waiter

    async def _wait(self) -> None:
        try:
            await self._arm()
        finally:
            self._waiter = None

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # not waiting: the next wait arms a new timer
        if self._loop.time() < self._deadline:
            self._timer = self._loop.call_at(self._deadline, self._on_timer)
            return
        if self._error is None:
            self._error = ReadTimeout(f"no bytes from the engine for {self._read_timeout:g}s")
        waiter.set_result(None)

    @property
    def failure(self) -> Http1Error | None:
        """The transport failure that ended this response, as this module raised it."""
        return self._error

    def _raise_error(self) -> NoReturn:
        """Raise what ``errors`` makes of a fresh copy of the stored error. Raised itself,
        it would carry the caller's frames in its traceback while this response holds it: a
        cycle that reference counting cannot free, keeping the response, its connection and
        those frames for the collector.
        """
        error = self._error
        assert error is not None
        _raise(self._errors, type(error)(*error.args))

    async def wait_headers(self) -> None:
        while not self._headers_in:
            if self._error is not None:
                self._raise_error()
            await self._wait()

    def __aiter__(self) -> Http1Response:
        return self

    async def __anext__(self) -> bytes:
        while True:
            chunks = self._chunks
            if chunks:  # what arrived since the last read, joined (_take, inline: per chunk)
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                if self._buffered > _HIGH_WATER:
                    self._conn.resume_reading()
                self._buffered = 0
                return data
            if self._error is not None:
                self._raise_error()
            if self._complete:
                raise StopAsyncIteration
            # _arm(), inline: this wait runs once per read of every stream (at 256 streams,
            # 256 times a decode step), and a call less each is measurable there.
            loop = self._loop
            waiter = self._waiter = loop.create_future()
            if self._read_timeout is not None:
                self._deadline = loop.time() + self._read_timeout
                if self._timer is None:
                    self._timer = loop.call_at(self._deadline, self._on_timer)
            try:
                await waiter
            finally:
                self._waiter = None

    def chunks(self) -> Http1Response:
        return self

    def splice(self, sink: Sink | None) -> bool:
        """Offer the body's chunks to ``sink`` as they arrive while the reader waits with
        nothing buffered (None: stop). ``sink`` takes a chunk (True) or refuses it (False:
        it is buffered and read, and the splice ends, as it does for a chunk that comes while
        the reader is not waiting); it runs in the connection's callback and must not raise.
        True: this stream splices."""
        self._sink = sink
        return True

    async def read_all(self) -> bytes:
        parts = [chunk async for chunk in self]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @property
    def ended(self) -> bool:
        """Every body byte has been handed out and the response is complete."""
        return self._complete and not self._chunks and self._error is None

    @property
    def reusable(self) -> bool:
        return self._complete and self._keep_alive and self._error is None

    def close(self) -> None:
        """Give the connection back (response complete) or close it (vLLM aborts); idempotent.

        A read of an incomplete response waiting for bytes (another task's) then
        raises ``ReadError`` at once rather than at its read timeout.
        """
        if not self._closed:
            self._closed = True
            self._sink = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if not self._complete and self._error is None:
                self._error = ReadError("the response was closed before its end")
                self._wake()
            self._conn.release(self)


class _Conn(asyncio.Protocol):
    """One TCP connection to an engine, carrying at most one request at a time."""

    def __init__(self, pool: Http1Pool, origin: Origin) -> None:
        self.origin = origin
        self.idle_since = 0.0
        self.lost = False
        self.got_bytes = False  # any byte of the current response
        self.transport: asyncio.Transport | None = None
        self._pool = pool
        self._response: Http1Response | None = None
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._paused = False

    # -- asyncio.Protocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        response, parser = self._response, self._parser
        if response is None or parser is None:  # bytes nobody asked for: unusable
            self._close_transport()
            return
        self.got_bytes = True
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response._on_malformed(str(exc))
            self._close_transport()

    def eof_received(self) -> bool | None:
        return False  # close our side too; connection_lost reports it

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        response = self._response
        if response is not None:
            response._on_lost(exc)
        else:
            self._pool.forget(self)
        # The parser holds this protocol's bound methods and the transport holds the
        # protocol: cycles that reference counting cannot free. Broken here, a closed
        # connection is freed at once instead of waiting (often minutes, since open
        # connections are old) for the collector's oldest generation.
        self._parser = None
        self.transport = None

    # -- httptools callbacks -----------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self._response
        if response is None:
            return
        lname = name.lower()
        if lname == b"content-type":
            response.content_type = value.decode("latin-1")
        elif lname in (b"content-length", b"transfer-encoding"):
            response._until_eof = False

    def on_headers_complete(self) -> None:
        parser = self._parser
        if self._response is not None and parser is not None:
            self._response._on_headers(parser.get_status_code(), parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        # The response's buffering and _wake(), inline: this runs for every chunk of every
        # stream (two calls fewer each).
        response = self._response
        if response is None:
            return
        sink = response._sink
        if sink is not None:
            # Offered only while the reader waits with nothing buffered and nothing failed:
            # while it handles a chunk read, a chunk taken now would overtake that one.
            waiting = response._waiter is not None and response._error is None
            if waiting and not response._chunks and sink(body):
                if response._read_timeout is not None:  # as a read: the deadline moves
                    response._deadline = response._loop.time() + response._read_timeout
                return
            response._sink = None  # refused, or not offered: this chunk and the next are read
        response._chunks.append(body)
        response._buffered += len(body)
        if response._buffered > _HIGH_WATER:
            self.pause_reading()
        waiter = response._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def on_message_complete(self) -> None:
        if self._response is not None:
            self._response._on_complete()

    # -- used by the pool and the response ---------------------------------------

    def start(
        self, head: bytes, body: bytes, read_timeout: float | None, errors: Errors
    ) -> Http1Response:
        assert self.transport is not None
        response = self._response = Http1Response(self, self._pool.loop, read_timeout, errors)
        self.got_bytes = False
        self.transport.write(head + body if body else head)
        return response

    def release(self, response: Http1Response) -> None:
        if response is not self._response:
            return
        self._response = None
        if response.reusable and not self.lost:
            self.resume_reading()
            self._pool.give_back(self)
        else:
            self._close_transport()

    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.lost:
            self._paused = False
            self.transport.resume_reading()

    def _close_transport(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    def close(self) -> None:
        self._close_transport()


class Http1Pool:
    """Keep-alive connections per origin, most recently used first."""

    def __init__(
        self,
        connect_timeout: float,
        keepalive_expiry: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive_expiry
        self._clock = clock
        # Per origin, idle connections in the order they were given back (a dict:
        # O(1) removal when the engine closes one, LIFO checkout with popitem()).
        self._idle: dict[Origin, dict[_Conn, None]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def request(
        self,
        origin: Origin,
        head: bytes,
        body: bytes,
        read_timeout: float | None,
        errors: Errors = _as_is,
    ) -> Http1Response:
        """Send one request; return once its response headers are in. Every failure, then
        and while the body is read, is raised as ``errors`` makes it (see module doc)."""
        conn = self._checkout(origin)
        if conn is not None:
            try:
                return await self._send(conn, head, body, read_timeout, errors, reused=True)
            except _StaleConnection:
                pass
        try:
            conn = await self._connect(origin)
        except Http1Error as exc:
            _raise(errors, exc)
        return await self._send(conn, head, body, read_timeout, errors, reused=False)

    async def _send(
        self,
        conn: _Conn,
        head: bytes,
        body: bytes,
        read_timeout: float | None,
        errors: Errors,
        *,
        reused: bool,
    ) -> Http1Response:
        response = conn.start(head, body, read_timeout, errors)
        try:
            await response.wait_headers()
        except BaseException as exc:
            failure = response.failure
            response.close()
            if reused and not conn.got_bytes and isinstance(failure, RemoteProtocolError):
                raise _StaleConnection from exc
            raise
        return response

    def _checkout(self, origin: Origin) -> _Conn | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        oldest_ok = self._clock() - self._keepalive
        while idle:
            conn, _ = idle.popitem()
            if not conn.lost and conn.idle_since >= oldest_ok:
                return conn
            conn.close()
        return None

    def give_back(self, conn: _Conn) -> None:
        if self._closed:  # a response read to its end after close()
            conn.close()
            return
        conn.idle_since = self._clock()
        idle = self._idle.get(conn.origin)
        if idle is None:
            idle = self._idle[conn.origin] = {}
        idle[conn] = None

    def forget(self, conn: _Conn) -> None:
        """An idle connection was closed (by the engine, or expired): drop it."""
        idle = self._idle.get(conn.origin)
        if idle is not None:
            idle.pop(conn, None)

    async def _connect(self, origin: Origin) -> _Conn:
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await self.loop.create_connection(
                    lambda: _Conn(self, origin),
                    origin.host,
                    origin.port,
                    ssl=self._ssl_context() if origin.scheme == "https" else None,
                )
        except TimeoutError as exc:
            raise ConnectTimeout(
                f"connecting to {origin.netloc} took over {self._connect_timeout:g}s"
            ) from exc
        except OSError as exc:
            raise ConnectError(f"cannot connect to {origin.netloc}: {exc}") from exc
        return conn

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def close(self) -> None:
        """Close every idle connection (those in use are closed by their responses)."""
        self._closed = True
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in list(conns):
                conn.close()
