"""The ASGI response that runs a P/D request and relays D's bytes to the client.

It is returned by the route before any upstream call, so one object sees the
whole life of the request: the dispatch (slot, legs, retries), the relay of D's
status and body chunk by chunk (no buffering, no re-encoding), the client's
disconnect turned into cancellation of everything upstream, and the final
accounting (metrics, breaker, slot release) on every exit path.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any, Protocol

from starlette.responses import Response

from router.access_log import AccessLog, AccessRecord
from router.client_request import ClientRequest
from router.config import MigrationConfig, TracingConfig
from router.engines.instance import Instance
from router.errors import (
    FairShareExceeded,
    Outcome,
    RouterError,
    ShuttingDown,
    TotalTimeout,
    UpstreamError,
    render,
    sse_error_event,
)
from router.metrics import Metrics
from router.pd.continuation import refusal
from router.pd.dispatch import Dispatcher
from router.pd.legs import DecodeLeg
from router.pd.migration import Migration
from router.pd.opened import Dispatch
from router.pd.sse import ends_answer
from router.registry import ModelPool
from router.tracing import Tracing

__all__ = [
    "CONNECTION",
    "Connection",
    "LoadReport",
    "Receive",
    "RelayResponse",
    "Scope",
    "Send",
    "send_error",
]

log = logging.getLogger("pd_router.relay")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
# The response headers that report an engine's load (router/orca.py), asked once D answered.
LoadReport = Callable[[Instance], Awaitable[list[tuple[bytes, bytes]]]]


async def send_error(send: Send, exc: RouterError, request_id: bytes | None = None) -> None:
    """The error as a whole response; ``request_id`` is the client's, echoed."""
    status, headers, body = render(exc, request_id)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# The scope key under which the server's protocol (router/guard.py) offers its connection.
CONNECTION = "pdrouter.connection"


class Connection(Protocol):
    """The client's connection as the server's protocol offers it (``scope[CONNECTION]``):
    ``lost`` once it is gone; ``on_lost``, if set, is called once when it goes. The relay
    sets it for the time of its exchange: a request pays an attribute write, not a task."""

    lost: bool
    on_lost: Callable[[], None] | None

    def hold_head(self) -> None:
        """Write the response head sent next together with the body message sent right
        after it (one write instead of two); the caller sends that body message at once."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class RelayResponse(Response):
    """A Starlette ``Response`` only so frameworks pass it through untouched."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        metrics: Metrics,
        pool: ModelPool,
        creq: ClientRequest,
        started_at: float,
        clock: Callable[[], float],
        total_timeout: float,
        client_id: bytes | None = None,
        tracing: Tracing | None = None,
        access: AccessLog | None = None,
        on_end: Callable[[], None] | None = None,
        load_report: LoadReport | None = None,
        migration: MigrationConfig | None = None,
    ) -> None:
        """``client_id``: the client's X-Request-Id, echoed back and logged. ``on_end`` is
        called once when the exchange is over, however it ended (the key's lease).
        ``load_report``: the ORCA header of D's load, for a non-streamed answer that D
        answered 200 (router/orca.py). ``migration``: the router's, for a request that may
        continue on another engine if D fails mid-stream (router/pd/migration.py)."""
        self.background = None
        self._load_report = load_report
        self._on_end = on_end
        self._access = access
        self._tracing = tracing or Tracing(TracingConfig())
        self._echo = client_id
        self._client_id = client_id.decode("latin-1") if client_id else "-"
        self._dispatcher = dispatcher
        self._metrics = metrics
        self._pool = pool
        self._creq = creq
        self._t0 = started_at
        self._clock = clock
        self._total = total_timeout
        self._started = False  # response headers sent
        self._complete = False  # last body message about to be sent
        self._ttft: float | None = None
        self._disconnected = False
        self._status = 0  # of the response head sent, if any
        self._dispatch: Dispatch | None = None  # the (first) opened dispatch, for the log
        self._conn: Connection | None = None  # the server's, if it offers it
        self._migration: Migration | None = None
        if migration is not None and migration.enabled:
            refused = refusal(creq, pool.config.kept_turns.enabled, migration.non_streamed)
            if refused is None:
                self._migration = Migration(dispatcher, pool, creq, self._client_id, migration)

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Coroutine[Any, Any, None]:
        # A plain function that returns the exchange to await, and the span only when traced:
        # every relayed chunk resumes each coroutine frame between the server and the relay.
        if self._tracing.enabled:
            return self._traced(scope, receive, send)
        return self._exchange(scope, receive, send)

    async def _traced(self, scope: Scope, receive: Receive, send: Send) -> None:
        attributes = {
            "gen_ai.request.model": self._pool.name,
            "pdrouter.mode": self._pool.mode.value,
        }
        if self._echo:
            attributes["pdrouter.client_request_id"] = self._client_id
        name = f"POST {self._creq.endpoint.value}"
        with self._tracing.request(name, scope["headers"], attributes):
            await self._exchange(scope, receive, send)

    async def _exchange(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None

        def on_lost() -> None:
            # After the last body message the connection may close by design.
            if not self._complete and not self._disconnected:
                self._disconnected = True
                task.cancel()

        conn: Connection | None = scope.get(CONNECTION)
        self._conn = conn
        watcher = None
        if conn is not None:
            conn.on_lost = on_lost
            if conn.lost:
                on_lost()
        else:
            # Another server (uvicorn's h11 protocol in tests): its receive() returns
            # http.disconnect once the client is gone, which a task per request waits for.
            watcher = asyncio.create_task(_wait_disconnect(receive))
            watcher.add_done_callback(lambda w: None if w.cancelled() else on_lost())
        outcome = Outcome.SUCCESS
        try:
            async with asyncio.timeout(self._total):
                outcome = await self._run(send)
        except asyncio.CancelledError:
            if not self._disconnected:
                # The server is shutting down past its grace period: end the
                # response properly so the client sees why, then stop.
                await self._fail_late_or_early(send, ShuttingDown())
                self._observe(Outcome.SHUTDOWN)
                raise
            task.uncancel()
            outcome = Outcome.DISCONNECT
            phase = "streaming" if self._started else "before_first_byte"
            self._metrics.disconnects.labels(self._pool.name, phase).inc()
        except TimeoutError:
            outcome = Outcome.TIMEOUT
            await self._fail_late_or_early(send, TotalTimeout(self._total))
        finally:
            self._complete = True  # a loss from here on is no disconnect of this request
            if conn is not None:
                if conn.on_lost is on_lost:  # not yet a pipelined next request's
                    conn.on_lost = None
            elif watcher is not None:
                watcher.cancel()
            if self._on_end is not None:
                self._on_end()
        self._observe(outcome)

    def _observe(self, outcome: Outcome) -> None:
        self._metrics.observe_request(self._pool.name, self._pool.mode, outcome, self._ttft)
        if self._access is not None and self._access.enabled:
            self._access.write(self._access_record(outcome))
        if not self._tracing.enabled:
            return
        self._tracing.set(pdrouter__outcome=outcome.value)
        if self._ttft is not None:
            self._tracing.set(pdrouter__ttft_s=self._ttft)
        if outcome is not Outcome.SUCCESS:
            self._tracing.failed(outcome.value)

    def _access_record(self, outcome: Outcome) -> AccessRecord:
        record = AccessRecord(
            method="POST",
            path=self._creq.endpoint.value,
            # 499 (as nginx logs it): the client left before any answer was sent.
            status=self._status or (499 if outcome is Outcome.DISCONNECT else 0),
            model=self._pool.name,
            mode=self._pool.mode.value,
            outcome=outcome.value,
            duration_ms=(self._clock() - self._t0) * 1000,
            client_id=self._client_id,
            ttft_ms=None if self._ttft is None else self._ttft * 1000,
            priority_class=self._creq.priority_class or "-",
            migrations=0 if self._migration is None else self._migration.count,
        )
        d = self._dispatch
        if d is not None:
            record.request_id, record.decision = d.request_id, d.decision.value
            record.prefill, record.decode = d.prefill or "-", d.decode or "-"
        return record

    async def _run(self, send: Send) -> Outcome:
        """Dispatch, send D's status and bytes; a broken stream ends with an SSE error event.
        The stream is forwarded here, not in a helper: every relayed chunk resumes each
        coroutine frame between the server and the relay loop."""
        if self._migration is not None:
            return await self._run_migrating(self._migration, send)
        try:
            async with self._dispatcher.dispatch(
                self._pool, self._creq, self._client_id
            ) as dispatch:
                head = await self._answer_head(dispatch, send)
                if head is not None:
                    leg, before_last = dispatch.leg, functools.partial(self._before_last, dispatch)
                    try:
                        with self._tracing.span("stream"):
                            await leg.forward(send, before_last, dispatch.usage_patch, head)
                            self._tracing.set(pdrouter__chunks=leg.chunks)
                    except UpstreamError as exc:
                        await self._stream_failed(dispatch, send, exc)
                    else:
                        if leg.error_event:
                            # D's own error event after its 200 (e.g. its KV read from P
                            # failed): relayed as is, counted as the upstream failure it is.
                            self._log_stream(dispatch, "stream_error_event", None)
        except RouterError as exc:
            return await self._refuse(send, exc)
        return Outcome.SUCCESS if dispatch.verdict is None else Outcome.UPSTREAM_ERROR

    async def _run_migrating(self, migration: Migration, send: Send) -> Outcome:
        """The request relayed event by event, continued on another engine if D fails
        mid-stream; this response is its :class:`~router.pd.migration.RelayHooks`."""
        try:
            return await migration.run(send, self)
        except RouterError as exc:
            return await self._refuse(send, exc)

    # -- RelayHooks (router/pd/migration.py) -----------------------------------

    def opened(self, dispatch: Dispatch) -> None:
        self._dispatch = dispatch

    async def as_is(self, dispatch: Dispatch, send: Send) -> Outcome:
        await self._answer_head(dispatch, send)  # a whole body: nothing left to relay
        return Outcome.SUCCESS if dispatch.verdict is None else Outcome.UPSTREAM_ERROR

    async def start(self, send: Send, leg: DecodeLeg, request_id: str) -> None:
        await self._start(send, leg, request_id)

    def first_byte(self) -> None:
        self._ttft = self._clock() - self._t0

    def stream_stats(self, dispatch: Dispatch) -> None:
        self._stream_stats(dispatch)

    async def end(self, send: Send, body: bytes) -> None:
        await self._end(send, body)

    async def whole(self, send: Send, body: bytes, request_id: str) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"x-request-id", self._echo or request_id.encode("latin-1")),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        self._started, self._status = True, 200
        self.first_byte()
        await self._end(send, body)

    async def _refuse(self, send: Send, exc: RouterError) -> Outcome:
        """Answer a dispatch that could not open with its error (logged and counted)."""
        if self._started:
            raise exc  # not from the dispatch's opening: a bug, not a refusal
        self._log_refusal(exc)
        if isinstance(exc, FairShareExceeded):
            self._metrics.key_requests.labels(self._creq.client_key, "queue_share_exceeded").inc()
        self._status = exc.status
        await send_error(send, exc, self._echo)
        return exc.outcome

    async def _start(self, send: Send, leg: DecodeLeg, request_id: str) -> None:
        """D's status and content type as the response head, with the request id (and the
        load report asked for, on a whole answer)."""
        headers = [
            (b"content-type", leg.content_type.encode("latin-1")),
            (b"x-request-id", self._echo or request_id.encode("latin-1")),
        ]
        if leg.rest is not None:
            headers.append((b"cache-control", b"no-cache"))
        elif self._load_report is not None and leg.status == 200:
            headers += await self._load_report(leg.instance)
        await send({"type": "http.response.start", "status": leg.status, "headers": headers})
        self._started = True
        self._status = leg.status

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

    async def _answer_head(self, dispatch: Dispatch, send: Send) -> bytes | None:
        """Send D's status and first bytes; None if that was the whole answer, else the
        bytes held back for :meth:`DecodeLeg.forward` (D's first read, when it already
        holds the answer's end: its [DONE] waits for D's end)."""
        leg = dispatch.leg
        self._dispatch = dispatch
        first = await dispatch.first_bytes()
        more = leg.rest is not None
        head = first if more and ends_answer(b"", first) else b""
        if not head and self._conn is not None:
            self._conn.hold_head()  # the first bytes follow at once: one write for both
        await self._start(send, leg, dispatch.request_id)
        self._complete = not more
        if not more:
            dispatch.ended_cleanly()
        if not head:
            await send({"type": "http.response.body", "body": first, "more_body": more})
        self._ttft = self._clock() - self._t0
        return head if more else None

    def _before_last(self, dispatch: Dispatch) -> None:
        self._stream_stats(dispatch)  # counted before the client sees the end
        self._complete = True
        dispatch.ended_cleanly()

    async def _stream_failed(self, dispatch: Dispatch, send: Send, exc: UpstreamError) -> None:
        """D's stream broke (or was cut because P failed): end it with an SSE error event."""
        self._stream_stats(dispatch)
        err = dispatch.prefill_error or exc
        self._log_stream(dispatch, "stream_failed", err)
        await self._end(send, sse_error_event(err.message, err.type, err.code))

    def _log_stream(self, dispatch: Dispatch, event: str, err: UpstreamError | None) -> None:
        if err is None:
            log.warning(
                "event=%s request_id=%s client_id=%s role=decode engine=%s",
                event,
                dispatch.request_id,
                self._client_id,
                dispatch.leg.instance.key,
            )
            return
        log.warning(
            "event=%s request_id=%s client_id=%s role=%s engine=%s reason=%r cause=%r",
            event,
            dispatch.request_id,
            self._client_id,
            err.role,
            err.instance,
            err.message,
            str(err.__cause__ or err.code),
        )

    def _stream_stats(self, dispatch: Dispatch) -> None:
        leg = dispatch.leg
        self._metrics.chunks.labels(self._pool.name).inc(leg.chunks)
        if leg.chunks > 1:
            self._metrics.max_chunk_gap.labels(self._pool.name, dispatch.decision).observe(
                leg.worst_gap
            )

    async def _end(self, send: Send, body: bytes) -> None:
        self._complete = True
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _fail_late_or_early(self, send: Send, exc: RouterError) -> None:
        with contextlib.suppress(Exception):
            if not self._started:
                self._status = exc.status
                await send_error(send, exc, self._echo)
            elif not self._complete:
                await self._end(send, sse_error_event(exc.message, exc.type, exc.code))
