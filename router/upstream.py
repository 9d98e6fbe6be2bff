"""The engine calls the router makes (:class:`UpstreamClient`), and their deadlines.

Built once by the composition root around one :class:`~router.carrier.Carrier`, which
carries every call: the router's own HTTP/1.1 client in production, an injected httpx
transport in tests and benchmarks (:mod:`router.carrier` has the contract, and where each
is chosen). Callers see only :class:`~router.errors.UpstreamError` and its subclasses,
naming the engine's role and URL (the messages name the role only: clients see them); the
deadlines of :meth:`UpstreamClient.within` expire here. :class:`UpstreamStream` is the one
seam between the engine calls and the legs: an open response whose body the caller reads,
closed synchronously.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import orjson

from router.carrier import DP_RANK_HEADER, Carrier, Engine, UpstreamStream
from router.config import TimeoutConfig
from router.errors import UpstreamTimeout

__all__ = ["DP_RANK_HEADER", "Answer", "Engine", "UpstreamClient", "UpstreamStream"]


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole response: status, body and content type."""

    status: int
    content: bytes
    content_type: str


def _expired(engine: Engine, code: str | None) -> UpstreamTimeout:
    role = str(engine.role)
    if engine.healthy is False:
        return UpstreamTimeout(
            f"{role} engine stopped answering health checks",
            role=role,
            engine=engine.key,
            code=f"{role}_unhealthy",
        )
    message = f"{role} engine did not answer in time"
    return UpstreamTimeout(
        message if code is None else f"{message} ({code})",
        role=role,
        engine=engine.key,
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


class UpstreamClient:
    """Every call to an engine, over ``carrier``; ``timeouts.idle`` is the default longest
    wait between a response's body bytes."""

    def __init__(self, timeouts: TimeoutConfig, carrier: Carrier) -> None:
        self._idle = timeouts.idle
        self._carrier = carrier

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
        timeout = self._idle if read_timeout is None else read_timeout
        return await self._carrier.post(
            engine, engine.url + path, _dumps(body), request_id, timeout, traceparent
        )

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

    async def get(self, engine: Engine, path: str, timeout: float) -> tuple[int, bytes]:
        """GET ``path`` on ``engine`` (probes, engine metrics): its status and whole body
        within ``timeout``."""
        return await self._carrier.get(engine, engine.url + path, timeout)

    async def aclose(self) -> None:
        await self._carrier.aclose()
