"""The one HTTP client the router uses to talk to engines.

Built once by the composition root around a single connection pool; tests and
benchmarks inject a transport. Transport failures are translated into the
router's error tree by :func:`map_errors`, naming the role and instance.

httpx stays the API, but its default transport (httpcore) is not used: its
connection pool scans every connection on each request and release (quadratic
in open streams), which profiled as >50% of the router's CPU at 256 streams and
capped it at a few dozen requests/s. :class:`AiohttpTransport` puts aiohttp's
pool (O(1) per request, C HTTP parser) under httpx, mapping aiohttp's errors to
the httpx exceptions the rest of the router (and :func:`map_errors`) expects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import httpx
import orjson

from router.config import TimeoutConfig
from router.errors import UpstreamError, UpstreamTimeout

__all__ = ["AiohttpTransport", "UpstreamClient", "UpstreamStream", "map_errors"]


@contextmanager
def map_errors(role: str, instance: str) -> Iterator[None]:
    """Turn httpx transport errors into :class:`UpstreamError` / :class:`UpstreamTimeout`."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise UpstreamTimeout(
            f"{role} engine {instance} timed out ({type(exc).__name__})",
            role=role,
            instance=instance,
            code=f"{role}_timeout",
        ) from exc
    except (httpx.TransportError, httpx.StreamError) as exc:
        raise UpstreamError(
            f"{role} engine {instance} failed: {type(exc).__name__}: {exc}",
            role=role,
            instance=instance,
            code=f"{role}_unreachable",
        ) from exc


def _httpx_error(exc: BaseException) -> httpx.TransportError | None:
    """The httpx exception httpcore would have raised for an aiohttp failure."""
    # Order matters: the timeout classes are also connection errors.
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(str(exc))
    if isinstance(exc, aiohttp.ServerTimeoutError):  # SocketTimeoutError: idle read
        return httpx.ReadTimeout(str(exc))
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(str(exc))
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientResponseError):
        return httpx.RemoteProtocolError(str(exc) or type(exc).__name__)
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ClientError | OSError):
        return httpx.ReadError(str(exc) or type(exc).__name__)
    return None


@contextmanager
def _aiohttp_errors() -> Iterator[None]:
    try:
        yield
    except (aiohttp.ClientError, OSError) as exc:
        mapped = _httpx_error(exc)
        if mapped is None:  # pragma: no cover
            raise
        raise mapped from exc


class _AiohttpBody(httpx.AsyncByteStream):
    """A response body: bytes as they arrive; closing an unfinished one closes
    the connection (which is how vLLM learns to abort)."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _aiohttp_errors():
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        # release() keeps the connection only if the body was read to its end.
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx transport on one aiohttp session (created lazily inside the loop)."""

    def __init__(self, max_connections: int, keepalive_expiry: float) -> None:
        self._limit = max_connections
        self._keepalive = keepalive_expiry
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._limit,
                limit_per_host=0,
                keepalive_timeout=self._keepalive,
                ttl_dns_cache=10,
                enable_cleanup_closed=False,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout", {})
        session = self._get_session()
        with _aiohttp_errors():
            response = await session.request(
                request.method,
                str(request.url),
                headers=request.headers.multi_items(),
                data=request.content or None,
                allow_redirects=False,
                compress=False,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=timeout.get("pool"),
                    sock_connect=timeout.get("connect"),
                    sock_read=timeout.get("read"),
                ),
            )
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=_AiohttpBody(response),
            request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class UpstreamStream:
    """An open response whose headers have arrived; the body is read by the caller.

    ``aclose()`` closes the connection, which makes vLLM abort the request.
    """

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.content_type: str = response.headers.get("content-type", "application/json")

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
        max_connections: int = 16384,
    ) -> None:
        self._base_headers = {"content-type": "application/json"}
        if upstream_key:
            self._base_headers["authorization"] = f"Bearer {upstream_key}"
        keepalive_expiry = 30.0
        if transport is None:
            transport = AiohttpTransport(max_connections, keepalive_expiry)
        self._transport = transport
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(
                connect=timeouts.connect,
                read=timeouts.idle,
                write=timeouts.idle,
                pool=timeouts.connect,
            ),
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=keepalive_expiry,
            ),
        )
        self._default_timeout = self._client.timeout.as_dict()
        # Parsed once per engine endpoint: URL parsing was a visible per-request cost.
        self._urls: dict[str, httpx.URL] = {}

    def _url(self, url: str) -> httpx.URL:
        parsed = self._urls.get(url)
        if parsed is None:
            parsed = self._urls[url] = httpx.URL(url)
        return parsed

    def _headers(self, request_id: str, length: int) -> list[tuple[str, str]]:
        # Content-Length given here so httpx does not compute and insert it.
        return [
            *self._base_headers.items(),
            ("x-request-id", request_id),
            ("content-length", str(length)),
        ]

    async def open(
        self,
        url: str,
        body: dict[str, Any],
        request_id: str,
        read_timeout: float | None = None,
    ) -> UpstreamStream:
        """POST ``body`` and return once the response headers are in.

        ``read_timeout`` overrides the idle timeout between body bytes (a
        non-streaming vLLM response sends nothing until it is complete).

        The request goes straight to the transport: the client's per-request
        layers (auth, redirects, cookie jar, event hooks, an INFO log line) do
        nothing for engine calls and cost as much as the transport itself.
        """
        timeout = self._default_timeout
        if read_timeout is not None:
            timeout = {**timeout, "read": read_timeout}
        content = orjson.dumps(body)
        target = self._url(url)
        request = httpx.Request(
            "POST",
            target,
            content=content,
            headers=[
                ("host", target.netloc.decode("ascii")),
                *self._headers(request_id, len(content)),
            ],
            extensions={"timeout": timeout},
        )
        response = await self._transport.handle_async_request(request)
        response.request = request
        return UpstreamStream(response)

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        response = await self._client.get(url, timeout=timeout, headers=self._base_headers)
        return response.status_code, response.content

    async def aclose(self) -> None:
        await self._client.aclose()
