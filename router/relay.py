"""The ASGI response that runs a P/D request and relays D's bytes to the client.

Returned by the route before any upstream call, it sees the whole life of the request: the
dispatch, D's status and body relayed chunk by chunk (no buffering, no re-encoding), the
client's disconnect (router/disconnect.py) turned into cancellation of everything upstream,
the total timeout, and the request's end announced on every exit path
(:meth:`~router.lifecycle.Lifecycle.request_ended`: metrics, tracing and the access log
observe it, router/observers/). It alone writes the client's ASGI messages: a leg yields
bytes and knows its end (:meth:`~router.pd.legs.DecodeLeg.forward`); an answer made of several
legs is a :class:`~router.composer.Composer` that hands it bytes through its hooks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from starlette.responses import Response

from router.asgi_types import BodyWriter, Receive, Scope, Send, send_error
from router.client_request import ClientRequest
from router.composer import Composer, Relaying
from router.disconnect import CONNECTION, Connection, watch
from router.engines.instance import Instance
from router.errors import (
    DisconnectPhase,
    FairShareExceeded,
    KeyResult,
    Outcome,
    RouterError,
    ShuttingDown,
    TotalTimeout,
    UpstreamError,
    sse_error_event,
)
from router.pd.decode_leg import DecodeLeg
from router.pd.dispatch import Dispatcher
from router.pd.opened import Dispatch
from router.pd.sse import ends_answer
from router.registry import ModelPool
from router.relay_log import log_refused, log_stream
from router.request_end import RequestEnd

# Re-exported: the names the routes, the guarded protocol and the tests know the relay by.
__all__ = ["CONNECTION", "Connection", "LoadReport", "RelayResponse", "Scope", "Send", "send_error"]
__all__ += ["Composer", "Receive", "Relaying"]

# The response headers that report an engine's load (router/orca.py), asked once D answered.
LoadReport = Callable[[Instance], Awaitable[list[tuple[bytes, bytes]]]]


class RelayResponse(Response):
    """A Starlette ``Response`` only so frameworks pass it through untouched; the
    :class:`~router.pd.migration.RelayHooks` of its :class:`Composer`, if any."""

    _send: Send  # the client's, from the exchange's start (what the hooks write to)

    def __init__(
        self,
        relaying: Relaying,
        pool: ModelPool,
        creq: ClientRequest,
        started_at: float,
        client_id: bytes | None = None,
        on_end: Callable[[], None] | None = None,
        load_report: LoadReport | None = None,
        composer: Composer | None = None,
    ) -> None:
        """``client_id``: the client's X-Request-Id, echoed back and logged. ``on_end`` is
        called once when the exchange is over, however it ended (the key's lease).
        ``load_report``: the ORCA header of D's load, for a non-streamed answer that D
        answered 200 (router/orca.py). ``composer``: what answers instead of one dispatch's
        D (a migrating stream, several prompts)."""
        self.background = None
        self._dispatcher: Dispatcher = relaying.dispatcher
        self._lifecycle = relaying.lifecycle
        self._clock, self._total = relaying.clock, relaying.total_timeout
        self._pool, self._creq = pool, creq
        self._echo, self._on_end = client_id, on_end
        self._load_report, self._composer = load_report, composer
        client = client_id.decode("latin-1") if client_id else "-"
        priority = creq.priority_class or "-"  # endpoint, mode: StrEnums, read where written
        self._end = RequestEnd(
            "POST", creq.endpoint, pool.name, pool.mode, started_at, client, priority
        )
        self._started = False  # response headers sent
        self._complete = False  # last body message about to be sent
        self._disconnected = False
        self._dispatch: Dispatch | None = None  # the (first) opened dispatch, for the log
        self._conn: Connection | None = None  # the server's, if it offers it

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Coroutine[Any, Any, None]:
        # A plain function that returns the exchange to await, and the span only when traced:
        # every relayed chunk resumes each coroutine frame between the server and the relay.
        if self._lifecycle.spans_requests:
            return self._traced(scope, receive, send)
        return self._exchange(scope, receive, send)

    async def _traced(self, scope: Scope, receive: Receive, send: Send) -> None:
        attributes = {
            "gen_ai.request.model": self._pool.name,
            "pdrouter.mode": self._pool.mode.value,
        }
        if self._echo:
            attributes["pdrouter.client_request_id"] = self._end.client_id
        name = f"POST {self._creq.endpoint.value}"
        with self._lifecycle.request_span(name, scope["headers"], attributes):
            await self._exchange(scope, receive, send)

    async def _exchange(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None

        def on_lost() -> None:
            # After the last body message the connection may close by design.
            if not self._complete and not self._disconnected:
                self._disconnected = True
                task.cancel()

        self._send, self._conn = send, scope.get(CONNECTION)
        stop_watching = watch(self._conn, receive, on_lost)
        outcome = Outcome.SUCCESS
        try:
            async with asyncio.timeout(self._total):
                outcome = await self._run(send)
        except asyncio.CancelledError:
            if not self._disconnected:
                # The server is shutting down past its grace period: end the
                # response properly so the client sees why, then stop.
                await self._fail_late_or_early(send, ShuttingDown())
                self._ended(Outcome.SHUTDOWN)
                raise
            task.uncancel()
            outcome = Outcome.DISCONNECT
            phase = (
                DisconnectPhase.STREAMING if self._started else DisconnectPhase.BEFORE_FIRST_BYTE
            )
            self._lifecycle.disconnected(self._pool.name, phase)
        except TimeoutError:
            outcome = Outcome.TIMEOUT
            await self._fail_late_or_early(send, TotalTimeout(self._total))
        finally:
            self._complete = True  # a loss from here on is no disconnect of this request
            stop_watching()
            if self._on_end is not None:
                self._on_end()
        self._ended(outcome)

    def _ended(self, outcome: Outcome) -> None:
        end = self._end
        end.outcome = outcome
        if self._composer is not None:
            end.migrations = self._composer.count
        d = self._dispatch
        if d is not None:
            end.request_id, end.decision = d.request_id, d.decision
            end.prefill, end.decode = d.prefill_engine or "-", d.decode_engine or "-"
        self._lifecycle.request_ended(end)

    async def _run(self, send: Send) -> Outcome:
        """Dispatch, send D's status and bytes; a broken stream ends with an SSE error event.
        The stream is relayed here, not in a helper: every relayed chunk resumes each
        coroutine frame between the server and the relay loop."""
        if self._composer is not None:
            return await self._compose(self._composer)
        try:
            async with self._dispatcher.dispatch(self._pool, self._creq, self._end.client_id) as d:
                head = await self._answer_head(d, send)
                if head is not None:
                    leg = d.leg
                    try:
                        with self._lifecycle.phase("stream"):
                            await leg.forward(self.more, d.usage_patch, head, self.writer())
                            self._before_last(d)
                            await self.end(leg.tail)
                            if self._lifecycle.annotates:
                                self._lifecycle.annotate({"pdrouter.chunks": leg.chunks})
                    except UpstreamError as exc:
                        await self._stream_failed(d, exc)
                    else:
                        if leg.error_event:
                            # D's own error event after its 200 (e.g. its KV read from P
                            # failed): relayed as is, counted as the upstream failure it is.
                            log_stream(d, "stream_error_event", self._end.client_id, None)
        except RouterError as exc:
            return await self._refuse(send, exc)
        return Outcome.SUCCESS if d.verdict is None else Outcome.UPSTREAM_ERROR

    async def _compose(self, composer: Composer) -> Outcome:
        try:
            return await composer.run(self)
        except RouterError as exc:
            return await self._refuse(self._send, exc)

    # -- RelayHooks (router/pd/migration.py): what a composer has the relay do ----------

    def opened(self, dispatch: Dispatch) -> None:
        self._dispatch = dispatch

    async def as_is(self, dispatch: Dispatch) -> Outcome:
        await self._answer_head(dispatch, self._send)  # a whole body: nothing left to relay
        return Outcome.SUCCESS if dispatch.verdict is None else Outcome.UPSTREAM_ERROR

    async def start(self, leg: DecodeLeg, request_id: str) -> None:
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
        await self._send({"type": "http.response.start", "status": leg.status, "headers": headers})
        self._started, self._end.status = True, leg.status

    def first_byte(self) -> None:
        self._end.ttft = self._clock() - self._end.started_at

    def stream_stats(self, dispatch: Dispatch) -> None:
        leg = dispatch.leg
        self._lifecycle.stream_read(self._pool.name, dispatch.decision, leg.chunks, leg.worst_gap)

    def writer(self) -> BodyWriter | None:
        """The client's body writer outside ``send`` (a spliced stream's), if the server has one."""
        return None if self._conn is None else self._conn.body_writer(self._send)

    def more(self, body: bytes) -> Awaitable[None]:
        # The send itself to await, not a coroutine of its own: no frame of its own per chunk.
        return self._send({"type": "http.response.body", "body": body, "more_body": True})

    async def end(self, body: bytes) -> None:
        self._complete = True
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def whole(self, body: bytes, request_id: str) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"x-request-id", self._echo or request_id.encode("latin-1")),
        ]
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})
        self._started, self._end.status = True, 200
        self.first_byte()
        await self.end(body)

    # -- the relay's own ------------------------------------------------------------------

    async def _refuse(self, send: Send, exc: RouterError) -> Outcome:
        """Answer a dispatch that could not open with its error (logged and counted)."""
        if self._started:
            raise exc  # not from the dispatch's opening: a bug, not a refusal
        log_refused(exc, self._end.client_id, self._pool.name)
        if isinstance(exc, FairShareExceeded):
            self._lifecycle.key_result(self._creq.api_key_name, KeyResult.QUEUE_SHARE_EXCEEDED)
        self._end.status = exc.status
        await send_error(send, exc, self._echo)
        return exc.outcome

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
        await self.start(leg, dispatch.request_id)
        self._complete = not more
        if not more:
            dispatch.ended_cleanly()
        if not head:
            await send({"type": "http.response.body", "body": first, "more_body": more})
        self.first_byte()
        return head if more else None

    def _before_last(self, dispatch: Dispatch) -> None:
        self.stream_stats(dispatch)  # counted before the client sees the end
        self._complete = True
        dispatch.ended_cleanly()

    async def _stream_failed(self, dispatch: Dispatch, exc: UpstreamError) -> None:
        """D's stream broke (or was cut because P failed): end it with an SSE error event."""
        self.stream_stats(dispatch)
        err = dispatch.prefill_error or exc
        log_stream(dispatch, "stream_failed", self._end.client_id, err)
        await self.end(sse_error_event(err.message, err.type, err.code))

    async def _fail_late_or_early(self, send: Send, exc: RouterError) -> None:
        with contextlib.suppress(Exception):
            if not self._started:
                self._end.status = exc.status
                await send_error(send, exc, self._echo)
            elif not self._complete:
                await self.end(sse_error_event(exc.message, exc.type, exc.code))
