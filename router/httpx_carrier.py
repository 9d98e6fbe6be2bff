"""An engine-call :class:`~router.carrier.Carrier` over an httpx transport: what tests and
benchmarks inject through ``create_app(config, transport=...)`` (``httpx.MockTransport``,
or httpx's own HTTP transport for ``bench/router_bench.py --targets pull+httpx``). The
production path never runs it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import httpx

from router.carrier import DP_RANK_HEADER, Engine, UpstreamStream, transport_error
from router.errors import UpstreamError

__all__ = ["HttpxCarrier"]

_FAILURES = (httpx.TransportError, httpx.StreamError)


def _translate(role: str, engine: str, exc: BaseException) -> UpstreamError:
    return transport_error(
        role,
        engine,
        exc,
        timed_out=isinstance(exc, httpx.TimeoutException),
        refused=isinstance(exc, httpx.ConnectError),
    )


class _HttpxStream:
    """:class:`~router.carrier.UpstreamStream` over an httpx response."""

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
        except _FAILURES as exc:
            raise _translate(self._role, self._instance, exc) from exc

    def splice(self, sink: Callable[[bytes], bool] | None) -> bool:
        return False  # httpx hands chunks only to a reader

    async def read_all(self) -> bytes:
        try:
            return await self._response.aread()
        except _FAILURES as exc:
            raise _translate(self._role, self._instance, exc) from exc

    def close(self) -> None:
        # httpx closes an async response only asynchronously: the carrier owns the task.
        if not self._closed:
            self._closed = True
            self._spawn(self._response.aclose())


class HttpxCarrier:
    """:class:`~router.carrier.Carrier` over ``transport``. ``connect``/``idle``: httpx's
    connect and default read timeouts; ``upstream_key``: the engines' bearer token."""

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport,
        connect: float,
        idle: float,
        upstream_key: str | None = None,
    ) -> None:
        self._transport = transport
        self._timeout = httpx.Timeout(idle, connect=connect)
        self._key = upstream_key
        self._client = self._new_client()
        self._closing: set[asyncio.Task[None]] = set()

    def _new_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=self._transport, timeout=self._timeout)

    async def post(
        self,
        engine: Engine,
        url: str,
        content: bytes,
        request_id: str,
        timeout: float,
        traceparent: str | None,
    ) -> UpstreamStream:
        headers = {"content-type": "application/json", "x-request-id": request_id}
        if traceparent is not None:
            headers["traceparent"] = traceparent
        if engine.rank is not None:
            headers[DP_RANK_HEADER] = str(engine.rank)
        if self._key:
            headers["authorization"] = f"Bearer {self._key}"
        request = self._client.build_request(
            "POST", url, content=content, headers=headers, timeout=httpx.Timeout(timeout)
        )
        role = str(engine.role)
        try:
            response = await self._client.send(request, stream=True)
        except _FAILURES as exc:
            raise _translate(role, engine.key, exc) from exc
        return _HttpxStream(response, role, engine.key, self._spawn_close)

    def _spawn_close(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def get(self, engine: Engine, url: str, timeout: float) -> tuple[int, bytes]:
        try:
            answer = await self._client.get(url, timeout=timeout)
        except _FAILURES as exc:
            raise _translate(str(engine.role), engine.key, exc) from exc
        return answer.status_code, answer.content

    async def aclose(self) -> None:
        await asyncio.gather(*self._closing, return_exceptions=True)
        await self._client.aclose()
        # Ready for another lifespan of the same app; the injected transport stays open.
        self._client = self._new_client()
