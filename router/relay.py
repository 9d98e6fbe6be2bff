"""The ASGI response that runs a P/D request and relays D's bytes to the client.

It is returned by the route before any upstream call, so one object sees the
whole life of the request: the dispatch (slot, legs, retries), the relay of D's
status and body chunk by chunk (no buffering, no re-encoding), a watcher that
turns a client disconnect into cancellation of everything upstream, and the
final accounting (metrics, breaker, slot release) on every exit path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import Response

from router.client_request import ClientRequest
from router.errors import (
    Fault,
    RouterError,
    ShuttingDown,
    TotalTimeout,
    UpstreamError,
    sse_error_event,
)
from router.metrics import Outcome
from router.pd.dispatch import Dispatch, Dispatcher
from router.registry import ModelPool
from router.upstream import map_errors

__all__ = ["Receive", "RelayResponse", "Scope", "Send", "outcome_of", "send_error"]

log = logging.getLogger("pd_router.relay")

# How vLLM reports a failure after a streaming response has started (the JSON of
# an error response as one SSE event). Generated text cannot contain it: inside
# the JSON of a token event its quotes are escaped.
_ENGINE_ERROR_EVENT = b'data: {"error"'

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def outcome_of(exc: RouterError) -> str:
    if exc.status == 504:
        return Outcome.TIMEOUT
    if exc.status in (429, 503) and not isinstance(exc, UpstreamError):
        return Outcome.NO_CAPACITY
    if isinstance(exc, UpstreamError) and exc.status >= 500:
        return Outcome.UPSTREAM_ERROR
    return Outcome.CLIENT_ERROR if exc.status < 500 else Outcome.UPSTREAM_ERROR


async def send_error(send: Send, exc: RouterError, request_id: bytes | None = None) -> None:
    """The error as a whole response; ``request_id`` is the client's, echoed."""
    headers = [(b"content-type", b"application/json")]
    headers += [(k.encode(), v.encode()) for k, v in exc.headers().items()]
    if request_id:
        headers.append((b"x-request-id", request_id))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": exc.body(), "more_body": False})


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class RelayResponse(Response):
    """A Starlette ``Response`` only so frameworks pass it through untouched."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        pool: ModelPool,
        creq: ClientRequest,
        observe: Callable[[str, float | None], None],
        started_at: float,
        clock: Callable[[], float],
        total_timeout: float,
        client_id: bytes | None = None,
    ) -> None:
        """``client_id``: the client's X-Request-Id, echoed back and logged."""
        self.background = None
        self._echo = client_id
        self._client_id = client_id.decode("latin-1") if client_id else "-"
        self._dispatcher = dispatcher
        self._pool = pool
        self._creq = creq
        self._observe = observe  # (outcome, ttft or None) -> None
        self._t0 = started_at
        self._clock = clock
        self._total = total_timeout
        self._started = False  # response headers sent
        self._complete = False  # last body message about to be sent
        self._ttft: float | None = None
        self._disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(_wait_disconnect(receive))

        def on_disconnect(w: asyncio.Task[None]) -> None:
            # After the last body message the server reports a disconnect by design.
            if not w.cancelled() and not self._complete:
                self._disconnected = True
                task.cancel()

        watcher.add_done_callback(on_disconnect)
        outcome = Outcome.SUCCESS
        try:
            async with asyncio.timeout(self._total):
                outcome = await self._run(send)
        except asyncio.CancelledError:
            if not self._disconnected:
                # The server is shutting down past its grace period: end the
                # response properly so the client sees why, then stop.
                await self._fail_late_or_early(send, ShuttingDown())
                self._observe(Outcome.SHUTDOWN, self._ttft)
                raise
            task.uncancel()
            outcome = Outcome.DISCONNECT
            phase = "streaming" if self._started else "before_first_byte"
            self._dispatcher.metrics.disconnects.labels(self._pool.name, phase).inc()
        except TimeoutError:
            outcome = Outcome.TIMEOUT
            await self._fail_late_or_early(send, TotalTimeout(self._total))
        finally:
            watcher.remove_done_callback(on_disconnect)
            watcher.cancel()
        self._observe(outcome, self._ttft)

    async def _run(self, send: Send) -> str:
        try:
            dispatch = await self._dispatcher.open(self._pool, self._creq, self._client_id)
        except RouterError as exc:
            self._log_refusal(exc)
            await send_error(send, exc, self._echo)
            return outcome_of(exc)
        fault: Fault | None = Fault.NONE  # no verdict unless the relay gives one
        try:
            fault = await self._relay(dispatch, send)
        finally:
            await self._dispatcher.finish(dispatch, fault)
        return Outcome.SUCCESS if fault is None else Outcome.UPSTREAM_ERROR

    def _log_refusal(self, exc: RouterError) -> None:
        log.warning(
            "event=refused request_id=%s client_id=%s model=%s status=%d code=%s reason=%r",
            getattr(exc, "request_id", "-"),
            self._client_id,
            self._pool.name,
            exc.status,
            exc.code,
            exc.message,
        )

    async def _relay(self, dispatch: Dispatch, send: Send) -> Fault | None:
        """Send D's status and bytes; None if D's response ended normally, else what
        its end says about D."""
        leg = dispatch.leg
        request_id = self._echo or dispatch.request_id.encode("latin-1")
        headers = [
            (b"content-type", leg.content_type.encode("latin-1")),
            (b"x-request-id", request_id),
        ]
        if leg.rest is not None:
            headers.append((b"cache-control", b"no-cache"))
        await send({"type": "http.response.start", "status": leg.status, "headers": headers})
        self._started = True
        if leg.rest is None:
            self._complete = True
            await send({"type": "http.response.body", "body": leg.first, "more_body": False})
            self._ttft = self._clock() - self._t0
            return None
        await send({"type": "http.response.body", "body": leg.first, "more_body": True})
        now = self._clock()
        self._ttft = now - self._t0
        stream = leg.stream
        last = b""
        worst = 0.0
        count = 1
        engine_error = _ENGINE_ERROR_EVENT in leg.first
        try:
            with map_errors("decode", leg.instance.url):
                async for chunk in leg.rest:
                    count += 1
                    engine_error = engine_error or _ENGINE_ERROR_EVENT in chunk
                    t = self._clock()
                    worst = max(worst, t - now)
                    now = t
                    if stream.ended:
                        # D's last bytes came with the end of its response: relay
                        # both in one write.
                        last = chunk
                        break
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as exc:
            leg.mark_ended()
            self._stream_stats(dispatch, count, worst)
            err = dispatch.prefill_error or exc
            log.warning(
                "event=stream_failed request_id=%s client_id=%s role=%s instance=%s "
                "reason=%r cause=%r",
                dispatch.request_id,
                self._client_id,
                err.role,
                err.instance,
                err.message,
                str(err.__cause__ or err.code),
            )
            await self._end(send, sse_error_event(err.message, err.type, err.code))
            return Fault.NONE if err is dispatch.prefill_error else exc.fault
        leg.mark_ended()
        self._stream_stats(dispatch, count, worst)
        await self._end(send, last)
        if engine_error:
            # D's own error event after its 200 (e.g. its KV read from P failed):
            # relayed as is, counted as the upstream failure it is.
            log.warning(
                "event=stream_error_event request_id=%s client_id=%s role=decode instance=%s",
                dispatch.request_id,
                self._client_id,
                leg.instance.url,
            )
            return Fault.ANSWER
        return None

    def _stream_stats(self, dispatch: Dispatch, chunks: int, worst_gap: float) -> None:
        metrics = self._dispatcher.metrics
        metrics.chunks.labels(self._pool.name).inc(chunks)
        if chunks > 1:
            metrics.max_chunk_gap.labels(self._pool.name, dispatch.decision).observe(worst_gap)

    async def _end(self, send: Send, body: bytes) -> None:
        self._complete = True
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _fail_late_or_early(self, send: Send, exc: RouterError) -> None:
        with contextlib.suppress(Exception):
            if not self._started:
                await send_error(send, exc, self._echo)
            elif not self._complete:
                await self._end(send, sse_error_event(exc.message, exc.type, exc.code))
