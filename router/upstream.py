"""The one HTTP client the router uses to talk to engines.

Built once by the composition root around a single keep-alive pool
(:mod:`router.http1`, an asyncio protocol on httptools: the engine-call path is
the router's hot path, and httpx's default transport, then httpx on aiohttp,
profiled as its largest cost). Tests may inject an httpx transport instead
(e.g. ``httpx.MockTransport``), which then carries every engine call. Transport
failures, raised as httpx exception types by both, are translated into the
router's error tree by :func:`map_errors`, naming the role and instance.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import httpx
import orjson

from router.config import TimeoutConfig
from router.errors import Fault, UpstreamError, UpstreamTimeout
from router.http1 import Http1Pool, Origin, split_url

__all__ = ["UpstreamClient", "UpstreamStream", "map_errors"]

# Below vLLM's (uvicorn's) 5 s keep-alive timeout: the router drops an idle
# connection before the engine would close it under a request being written.
KEEPALIVE_EXPIRY_S = 4.0


def _dumps(body: dict[str, Any]) -> bytes:
    """JSON bytes of a leg's body; integers past 64 bits (which orjson refuses) go
    through the standard library, so they reach the engine as the client sent them."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


@contextmanager
def map_errors(role: str, instance: str) -> Iterator[None]:
    """Turn httpx transport errors into :class:`UpstreamError` / :class:`UpstreamTimeout`.

    Messages name the role, never the instance (clients see them); the instance
    travels on the error for logs, retries and outlier detection.
    """
    try:
        yield
    except httpx.TimeoutException as exc:
        raise UpstreamTimeout(
            f"{role} engine timed out ({type(exc).__name__})",
            role=role,
            instance=instance,
            code=f"{role}_timeout",
        ) from exc
    except httpx.ConnectError as exc:
        raise UpstreamError(
            f"cannot connect to the {role} engine",
            role=role,
            instance=instance,
            code=f"{role}_unreachable",
            fault=Fault.REFUSED,
        ) from exc
    except (httpx.TransportError, httpx.StreamError) as exc:
        raise UpstreamError(
            f"{role} engine failed: {type(exc).__name__}",
            role=role,
            instance=instance,
            code=f"{role}_unreachable",
        ) from exc


class UpstreamStream(Protocol):
    """An open response whose headers have arrived; the body is read by the caller.

    ``aclose()`` before the end closes the connection, which makes vLLM abort
    the request; it is idempotent.
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

    async def aclose(self) -> None: ...


class _HttpxStream:
    """:class:`UpstreamStream` over an httpx response (injected transports)."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.content_type: str = response.headers.get("content-type", "application/json")

    @property
    def ended(self) -> bool:
        return False  # httpx does not tell before the next read

    def chunks(self) -> AsyncIterator[bytes]:
        return self._response.aiter_raw()

    async def read_all(self) -> bytes:
        return await self._response.aread()

    async def aclose(self) -> None:
        await self._response.aclose()


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
        self._posts: dict[str, tuple[Origin, bytes]] = {}
        # An injected transport (tests, benchmarks) goes through httpx instead.
        self._transport = transport
        self._timeout = httpx.Timeout(timeouts.idle, connect=timeouts.connect)
        self._httpx: httpx.AsyncClient | None = None
        if transport is not None:
            self._httpx = self._new_httpx()

    def _new_httpx(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=self._transport, timeout=self._timeout)

    def _post_head(self, url: str) -> tuple[Origin, bytes]:
        known = self._posts.get(url)
        if known is None:
            origin, target = split_url(url)
            head = (
                f"POST {target} HTTP/1.1\r\nhost: {origin.netloc}\r\n"
                f"content-type: application/json\r\n{self._auth}"
            )
            known = self._posts[url] = (origin, head.encode("latin-1"))
        return known

    async def open(
        self,
        url: str,
        body: dict[str, Any],
        request_id: str,
        read_timeout: float | None = None,
        traceparent: str | None = None,
    ) -> UpstreamStream:
        """POST ``body`` and return once the response headers are in.

        ``read_timeout`` overrides the idle timeout between body bytes (a
        non-streaming vLLM response sends nothing until it is complete).
        ``traceparent`` (W3C trace context) is sent when given.
        """
        content = _dumps(body)
        timeout = self._idle if read_timeout is None else read_timeout
        if self._httpx is not None:
            return await self._open_httpx(url, content, request_id, timeout, traceparent)
        origin, head = self._post_head(url)
        if traceparent is not None:
            head += b"traceparent: %s\r\n" % traceparent.encode("latin-1")
        head += b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n" % (
            request_id.encode("latin-1"),
            len(content),
        )
        return await self._pool.request(origin, head, content, timeout)

    async def _open_httpx(
        self, url: str, content: bytes, request_id: str, timeout: float, traceparent: str | None
    ) -> UpstreamStream:
        assert self._httpx is not None
        headers = {"content-type": "application/json", "x-request-id": request_id}
        if traceparent is not None:
            headers["traceparent"] = traceparent
        if self._key:
            headers["authorization"] = f"Bearer {self._key}"
        request = self._httpx.build_request(
            "POST", url, content=content, headers=headers, timeout=httpx.Timeout(timeout)
        )
        return _HttpxStream(await self._httpx.send(request, stream=True))

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        """GET ``url`` (probes, engine metrics): its status and whole body within ``timeout``."""
        if self._httpx is not None:
            answer = await self._httpx.get(url, timeout=timeout)
            return answer.status_code, answer.content
        origin, target = split_url(url)
        head = f"GET {target} HTTP/1.1\r\nhost: {origin.netloc}\r\n{self._auth}\r\n"
        try:
            async with asyncio.timeout(timeout):
                response = await self._pool.request(origin, head.encode("latin-1"), b"", timeout)
                try:
                    return response.status, await response.read_all()
                finally:
                    response.close()
        except TimeoutError as exc:
            raise httpx.ReadTimeout(f"GET {url} took over {timeout:g}s") from exc

    async def aclose(self) -> None:
        self._pool.close()
        if self._httpx is not None:
            await self._httpx.aclose()
            # Ready for another lifespan of the same app (ASGI test clients run one per
            # session); the injected transport itself stays open.
            self._httpx = self._new_httpx()
