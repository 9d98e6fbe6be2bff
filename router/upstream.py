"""The one HTTP client the router uses to talk to engines.

Built once by the composition root around a single connection pool; tests and
benchmarks inject a transport. Transport failures are translated into the
router's error tree by :func:`map_errors`, naming the role and instance.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import orjson

from router.config import TimeoutConfig
from router.errors import UpstreamError, UpstreamTimeout

__all__ = ["UpstreamClient", "UpstreamStream", "map_errors"]


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
                keepalive_expiry=30.0,
            ),
        )

    def _headers(self, request_id: str) -> dict[str, str]:
        return {**self._base_headers, "x-request-id": request_id}

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
        """
        timeout = self._client.timeout
        if read_timeout is not None:
            timeout = httpx.Timeout(
                connect=timeout.connect, read=read_timeout, write=timeout.write, pool=timeout.pool
            )
        request = self._client.build_request(
            "POST",
            url,
            content=orjson.dumps(body),
            headers=self._headers(request_id),
            timeout=timeout,
        )
        response = await self._client.send(request, stream=True)
        return UpstreamStream(response)

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        response = await self._client.get(url, timeout=timeout, headers=self._base_headers)
        return response.status_code, response.content

    async def aclose(self) -> None:
        await self._client.aclose()
