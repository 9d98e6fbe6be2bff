"""The one HTTP client the router uses to talk to engines, and the one place where a
failed engine call becomes one of the router's errors.

Built once by the composition root around a single keep-alive pool
(:mod:`router.http1`, an asyncio protocol on httptools: the engine-call path is the
router's hot path: ``bench/router_bench.py --targets pull,pull+httpx`` measures it
against httpx, docs/benchmarks.md has the figures). Tests may inject an httpx transport
instead (e.g. ``httpx.MockTransport``), which then carries every engine call.

Contract: whatever carries the call, its callers see only
:class:`~router.errors.UpstreamError` and its subclasses, naming the engine's role
and URL (the messages name the role only: clients see them). Transport failures are
translated here, by :func:`_translate`, whether raised while connecting, waiting for
the headers or reading the body; the deadlines of :meth:`UpstreamClient.within`
expire here too. :class:`UpstreamStream` is the one seam between this module and the
legs: an open response whose body the caller reads, closed synchronously.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import httpx
import orjson

from router.config import TimeoutConfig
from router.errors import Fault, UpstreamError, UpstreamTimeout
from router.http1 import ConnectError, Http1Pool, Http1Timeout, Origin, ReadTimeout, split_url

__all__ = ["DP_RANK_HEADER", "Answer", "Engine", "UpstreamClient", "UpstreamStream"]

# Below vLLM's (uvicorn's) 5 s keep-alive timeout: the router drops an idle
# connection before the engine would close it under a request being written.
KEEPALIVE_EXPIRY_S = 4.0

# vLLM's API server runs a request on this data-parallel rank (generate/base/serving.py).
DP_RANK_HEADER = "x-data-parallel-rank"


class Engine(Protocol):
    """An engine as an engine call names it (:class:`~router.engines.instance.Instance`)."""

    @property
    def url(self) -> str: ...

    @property
    def rank(self) -> int | None:
        """The data-parallel rank every POST pins (``X-data-parallel-rank``); None: none."""
        ...

    @property
    def key(self) -> str:
        """The engine's name in errors (its URL, or the URL and its rank)."""
        ...

    @property
    def role(self) -> str: ...

    @property
    def healthy(self) -> bool | None: ...

    def deadline(self, cm: asyncio.Timeout) -> AbstractContextManager[None]:
        """Register a running deadline that expires at once if the engine turns unhealthy."""
        ...


class UpstreamStream(Protocol):
    """An open response whose headers have arrived; the body is read by the caller.

    Reading raises only :class:`~router.errors.UpstreamError`. ``close()`` before the
    end closes the connection, which makes vLLM abort the request; it is synchronous
    (nothing can interrupt it) and idempotent.
    """

    @property
    def status(self) -> int: ...

    @property
    def content_type(self) -> str: ...

    @property
    def ended(self) -> bool:
        """Every body byte has been handed out and the response is complete."""
        ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read_all(self) -> bytes: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole response: status, body and content type."""

    status: int
    content: bytes
    content_type: str


def _translate(role: str, instance: str, exc: BaseException) -> UpstreamError:
    """A transport failure (this router's HTTP/1.1 client's or httpx's) as the router's
    error, its cause the original (logged as the attempt's ``cause``)."""
    if isinstance(exc, (Http1Timeout, httpx.TimeoutException)):
        error: UpstreamError = UpstreamTimeout(
            f"{role} engine timed out ({type(exc).__name__})",
            role=role,
            instance=instance,
            code=f"{role}_timeout",
        )
    elif isinstance(exc, (ConnectError, httpx.ConnectError)):
        error = UpstreamError(
            f"cannot connect to the {role} engine",
            role=role,
            instance=instance,
            code=f"{role}_unreachable",
            fault=Fault.REFUSED,
        )
    else:
        error = UpstreamError(
            f"{role} engine failed: {type(exc).__name__}",
            role=role,
            instance=instance,
            code=f"{role}_unreachable",
        )
    error.__cause__ = exc
    return error


def _expired(engine: Engine, code: str | None) -> UpstreamTimeout:
    role = str(engine.role)
    if engine.healthy is False:
        return UpstreamTimeout(
            f"{role} engine stopped answering health checks",
            role=role,
            instance=engine.key,
            code=f"{role}_unhealthy",
        )
    message = f"{role} engine did not answer in time"
    return UpstreamTimeout(
        message if code is None else f"{message} ({code})",
        role=role,
        instance=engine.key,
        code=f"{role}_timeout" if code is None else code,
    )


class _Within:
    """:meth:`UpstreamClient.within`: a class, not an ``asynccontextmanager`` (whose generator
    costs about ten calls more), as every leg of every request enters one. A
    ``TimeoutError`` leaving the block, the deadline's or not, becomes the engine's error."""

    __slots__ = ("_code", "_engine", "_timeout", "_watch", "_watched")

    def __init__(self, engine: Engine, seconds: float, code: str | None, watched: bool) -> None:
        self._engine, self._code, self._watched = engine, code, watched
        self._timeout = asyncio.timeout(seconds)
        self._watch: AbstractContextManager[None] | None = None

    async def __aenter__(self) -> None:
        cm = await self._timeout.__aenter__()
        if self._watched:
            watch = self._engine.deadline(cm)
            watch.__enter__()
            self._watch = watch

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            try:
                if self._watch is not None:
                    self._watch.__exit__(kind, exc, tb)
            finally:
                await self._timeout.__aexit__(kind, exc, tb)
        except TimeoutError:
            raise _expired(self._engine, self._code) from None
        if exc is not None and isinstance(exc, TimeoutError):
            raise _expired(self._engine, self._code) from None


def _dumps(body: dict[str, Any]) -> bytes:
    """JSON bytes of a leg's body; integers past 64 bits (which orjson refuses) go
    through the standard library, so they reach the engine as the client sent them."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


class _HttpxStream:
    """:class:`UpstreamStream` over an httpx response (injected transports)."""

    def __init__(
        self,
        response: httpx.Response,
        role: str,
        instance: str,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self._response = response
        self._role, self._instance = role, instance
        self._spawn = spawn
        self._closed = False
        self.status = response.status_code
        self.content_type: str = response.headers.get("content-type", "application/json")

    @property
    def ended(self) -> bool:
        return False  # httpx does not tell before the next read

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except (httpx.TransportError, httpx.StreamError) as exc:
            raise _translate(self._role, self._instance, exc) from exc

    async def read_all(self) -> bytes:
        try:
            return await self._response.aread()
        except (httpx.TransportError, httpx.StreamError) as exc:
            raise _translate(self._role, self._instance, exc) from exc

    def close(self) -> None:
        # httpx closes an async response only asynchronously: the client owns the task.
        if not self._closed:
            self._closed = True
            self._spawn(self._response.aclose())


class UpstreamClient:
    def __init__(
        self,
        timeouts: TimeoutConfig,
        upstream_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._key = upstream_key
        self._auth = f"authorization: Bearer {upstream_key}\r\n" if upstream_key else ""
        self._idle = timeouts.idle
        self._pool = Http1Pool(timeouts.connect, KEEPALIVE_EXPIRY_S)
        # Per engine URL: its origin and the request head up to the per-request
        # headers, built once (URL parsing was a visible per-request cost).
        self._posts: dict[tuple[str, int | None], tuple[Origin, bytes]] = {}
        # An injected transport (tests, benchmarks) goes through httpx instead.
        self._transport = transport
        self._timeout = httpx.Timeout(timeouts.idle, connect=timeouts.connect)
        self._httpx: httpx.AsyncClient | None = None
        self._closing: set[asyncio.Task[None]] = set()
        if transport is not None:
            self._httpx = self._new_httpx()

    def _new_httpx(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=self._transport, timeout=self._timeout)

    def _post_head(self, url: str, rank: int | None) -> tuple[Origin, bytes]:
        known = self._posts.get((url, rank))
        if known is None:
            origin, target = split_url(url)
            head = (
                f"POST {target} HTTP/1.1\r\nhost: {origin.netloc}\r\n"
                f"content-type: application/json\r\n{self._auth}"
            )
            if rank is not None:
                head += f"{DP_RANK_HEADER}: {rank}\r\n"
            known = self._posts[(url, rank)] = (origin, head.encode("latin-1"))
        return known

    def within(
        self, engine: Engine, seconds: float, code: str | None = None, *, watched: bool = False
    ) -> AbstractAsyncContextManager[None]:
        """At most ``seconds`` for what runs inside, else :class:`UpstreamTimeout` (``code``,
        default ``<role>_timeout``). ``watched``: cut short, as ``<role>_unhealthy``, if the
        health monitor finds the engine unhealthy meanwhile (a frozen engine then costs the
        detection time, not the whole timeout)."""
        return _Within(engine, seconds, code, watched)

    async def open(
        self,
        engine: Engine,
        path: str,
        body: dict[str, Any],
        request_id: str,
        read_timeout: float | None = None,
        traceparent: str | None = None,
    ) -> UpstreamStream:
        """POST ``body`` to ``path`` on ``engine`` and return once the response headers are
        in. ``read_timeout`` overrides the idle timeout between body bytes (a non-streaming
        vLLM response sends nothing until it is complete). ``traceparent`` (W3C trace
        context) is sent when given."""
        content = _dumps(body)
        timeout = self._idle if read_timeout is None else read_timeout
        url = engine.url + path
        if self._httpx is not None:
            return await self._open_httpx(engine, url, content, request_id, timeout, traceparent)
        origin, head = self._post_head(url, engine.rank)
        if traceparent is not None:
            head += b"traceparent: %s\r\n" % traceparent.encode("latin-1")
        head += b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n" % (
            request_id.encode("latin-1"),
            len(content),
        )
        errors = functools.partial(_translate, str(engine.role), engine.key)
        return await self._pool.request(origin, head, content, timeout, errors)

    async def call(
        self,
        engine: Engine,
        path: str,
        body: dict[str, Any],
        request_id: str,
        read_timeout: float | None = None,
        traceparent: str | None = None,
    ) -> Answer:
        """:meth:`open`, the whole body read, the connection given back."""
        stream = await self.open(engine, path, body, request_id, read_timeout, traceparent)
        try:
            return Answer(stream.status, await stream.read_all(), stream.content_type)
        finally:
            stream.close()

    async def _open_httpx(
        self,
        engine: Engine,
        url: str,
        content: bytes,
        request_id: str,
        timeout: float,
        traceparent: str | None,
    ) -> UpstreamStream:
        assert self._httpx is not None
        headers = {"content-type": "application/json", "x-request-id": request_id}
        if traceparent is not None:
            headers["traceparent"] = traceparent
        if engine.rank is not None:
            headers[DP_RANK_HEADER] = str(engine.rank)
        if self._key:
            headers["authorization"] = f"Bearer {self._key}"
        request = self._httpx.build_request(
            "POST", url, content=content, headers=headers, timeout=httpx.Timeout(timeout)
        )
        role = str(engine.role)
        try:
            response = await self._httpx.send(request, stream=True)
        except (httpx.TransportError, httpx.StreamError) as exc:
            raise _translate(role, engine.key, exc) from exc
        return _HttpxStream(response, role, engine.key, self._spawn_close)

    def _spawn_close(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def get(self, engine: Engine, path: str, timeout: float) -> tuple[int, bytes]:
        """GET ``path`` on ``engine`` (probes, engine metrics): its status and whole body
        within ``timeout``."""
        role, url = str(engine.role), engine.url + path
        if self._httpx is not None:
            try:
                answer = await self._httpx.get(url, timeout=timeout)
            except (httpx.TransportError, httpx.StreamError) as exc:
                raise _translate(role, engine.key, exc) from exc
            return answer.status_code, answer.content
        origin, target = split_url(url)
        head = f"GET {target} HTTP/1.1\r\nhost: {origin.netloc}\r\n{self._auth}\r\n"
        errors = functools.partial(_translate, role, engine.key)
        try:
            async with asyncio.timeout(timeout):
                response = await self._pool.request(
                    origin, head.encode("latin-1"), b"", timeout, errors
                )
                try:
                    return response.status, await response.read_all()
                finally:
                    response.close()
        except TimeoutError:
            cause = ReadTimeout(f"GET {url} took over {timeout:g}s")
            raise errors(cause) from cause

    async def aclose(self) -> None:
        self._pool.close()
        await asyncio.gather(*self._closing, return_exceptions=True)
        if self._httpx is not None:
            await self._httpx.aclose()
            # Ready for another lifespan of the same app (ASGI test clients run one per
            # session); the injected transport itself stays open.
            self._httpx = self._new_httpx()
