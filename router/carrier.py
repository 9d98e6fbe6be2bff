"""The seam between the engine calls and what carries them: one protocol (:class:`Carrier`),
two implementations, chosen where the client is built (``router/context.py``).

:class:`Http1Carrier` is the production one: a single keep-alive pool on this router's
HTTP/1.1 client (:mod:`router.http1`, an asyncio protocol on httptools; the engine-call path
is the router's hot path: ``bench/router_bench.py --targets pull,pull+httpx`` measures it
against httpx, docs/bench-router.md has the figures). :class:`~router.httpx_carrier.HttpxCarrier`
carries the calls over an httpx transport that tests or benchmarks inject (for example
``httpx.MockTransport``).

Contract of every carrier: what it raises is :class:`~router.errors.UpstreamError` and its
subclasses only, naming the engine's role and URL (messages name the role only: clients see
them), whether the failure came while connecting, waiting for the headers or reading the
body; :class:`UpstreamStream` is an open response whose body the caller reads, closed
synchronously.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from typing import Protocol

from router.errors import Fault, UpstreamError, UpstreamTimeout
from router.http1 import ConnectError, Http1Pool, Http1Timeout, Origin, ReadTimeout, split_url

__all__ = [
    "DP_RANK_HEADER",
    "Carrier",
    "Engine",
    "Http1Carrier",
    "UpstreamStream",
    "transport_error",
]

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

    def splice(self, sink: Callable[[bytes], bool] | None) -> bool:
        """Offer the body's chunks to ``sink`` as they arrive while nothing is buffered
        (:meth:`router.http1.Http1Response.splice` has the contract); False: this stream
        cannot (its chunks are only read)."""
        ...

    async def read_all(self) -> bytes: ...

    def close(self) -> None: ...


class Carrier(Protocol):
    """What carries an engine call. ``url`` is the engine's URL plus the path."""

    async def post(
        self,
        engine: Engine,
        url: str,
        content: bytes,
        request_id: str,
        timeout: float,
        traceparent: str | None,
    ) -> UpstreamStream:
        """POST JSON ``content``; return once the response headers are in. ``timeout``: the
        longest wait between body bytes. ``traceparent`` is sent when given."""
        ...

    async def get(self, engine: Engine, url: str, timeout: float) -> tuple[int, bytes]:
        """GET: the status and the whole body within ``timeout``."""
        ...

    async def aclose(self) -> None:
        """Close every connection; the carrier may be used again afterwards (ASGI test
        clients run one lifespan per session)."""
        ...


def transport_error(
    role: str, engine: str, exc: BaseException, *, timed_out: bool, refused: bool
) -> UpstreamError:
    """A transport failure as the router's error, its cause the original (logged as the
    attempt's ``cause``). ``timed_out``/``refused``: what the carrier found the failure to be."""
    if timed_out:
        error: UpstreamError = UpstreamTimeout(
            f"{role} engine timed out ({type(exc).__name__})",
            role=role,
            engine=engine,
            code=f"{role}_timeout",
        )
    elif refused:
        error = UpstreamError(
            f"cannot connect to the {role} engine",
            role=role,
            engine=engine,
            code=f"{role}_unreachable",
            fault=Fault.REFUSED,
        )
    else:
        error = UpstreamError(
            f"{role} engine failed: {type(exc).__name__}",
            role=role,
            engine=engine,
            code=f"{role}_unreachable",
        )
    error.__cause__ = exc
    return error


def _translate(role: str, engine: str, exc: BaseException) -> UpstreamError:
    return transport_error(
        role,
        engine,
        exc,
        timed_out=isinstance(exc, Http1Timeout),
        refused=isinstance(exc, ConnectError),
    )


class Http1Carrier:
    """:class:`Carrier` on this router's HTTP/1.1 client: one keep-alive pool for every engine;
    each request head built once per URL up to its per-request headers (URL parsing was a
    visible per-request cost)."""

    def __init__(self, connect_timeout: float, upstream_key: str | None = None) -> None:
        self._auth = f"authorization: Bearer {upstream_key}\r\n" if upstream_key else ""
        self._pool = Http1Pool(connect_timeout, KEEPALIVE_EXPIRY_S)
        self._posts: dict[tuple[str, int | None], tuple[Origin, bytes]] = {}

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

    async def post(
        self,
        engine: Engine,
        url: str,
        content: bytes,
        request_id: str,
        timeout: float,
        traceparent: str | None,
    ) -> UpstreamStream:
        origin, head = self._post_head(url, engine.rank)
        if traceparent is not None:
            head += b"traceparent: %s\r\n" % traceparent.encode("latin-1")
        head += b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n" % (
            request_id.encode("latin-1"),
            len(content),
        )
        errors = functools.partial(_translate, str(engine.role), engine.key)
        return await self._pool.request(origin, head, content, timeout, errors)

    async def get(self, engine: Engine, url: str, timeout: float) -> tuple[int, bytes]:
        origin, target = split_url(url)
        head = f"GET {target} HTTP/1.1\r\nhost: {origin.netloc}\r\n{self._auth}\r\n"
        errors = functools.partial(_translate, str(engine.role), engine.key)
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
