"""Mid-stream migration: a streamed answer whose D breaks continues on another engine.

Without migration, D's failure after the client's first byte ends the client's stream with an
SSE error event. With ``migration.max_attempts`` above 0, a request that may be migrated
(:func:`router.pd.continuation.refusal`) is relayed event by event instead of byte by byte:

1. Its first dispatch asks the engines for token ids (``return_token_ids``). Each SSE event's
   ids are recorded (ordinary token events read in batches) and made null in what the client
   gets unless it asked for them (:class:`~router.pd.progress.Progress`); it is sent whole.
2. D's stream is *cut* when its connection breaks or closes before ``[DONE]`` (cause
   ``disconnect``), when it sends an error event (``error_event``), or when it has been
   waited on for ``migration.stall_timeout`` seconds without a byte (``stall``: the stream is
   closed), or when D leaves rotation ejected (its breaker open or its health checks failed:
   ``ejected``; the stream is closed, only if the request can go elsewhere). Nothing of a cut
   event is sent: the client has exactly the events read whole before the cut.
3. The cut leg's dispatch is left first, as any ended dispatch is (its slot released once, D
   judged by the cut's fault, its connection closed: vLLM aborts there). Then the
   continuation (:func:`~router.pd.continuation.continuation`) is dispatched as a new request
   by the model's rules (decode slot first), preferring a D that has not failed this
   request (with none in rotation, in a disaggregated mode, by a P alone: ``prefill_alone``),
   and its events are relayed as the first leg's (same id, created, model, index;
   a chat's re-wrapped as chat chunks; usage counting every token the client received). A
   cut before any event reached the client sends the request again as it came.
4. At most ``max_attempts`` continuations; none once the client has left (its disconnect
   cancels the whole exchange), none without another engine to go to, none where an engine
   returned no token ids. Then the stream ends with the error event, as without migration.
   An answer cut after its last token (its final chunk or usage not yet read) is closed by
   the router itself: there is nothing left to generate.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import orjson

from router.client_request import ClientRequest
from router.config import MigrationConfig
from router.engines.instance import Instance, Role
from router.errors import (
    Fault,
    MigrationCause,
    Outcome,
    RouterError,
    UpstreamError,
    UpstreamTimeout,
    sse_error_event,
)
from router.pd.continuation import continuation, remaining, with_token_ids
from router.pd.cut import Cut, SseEvents, StallWatch, cut, ended_early
from router.pd.dispatch import Dispatcher
from router.pd.event_splice import LegReading
from router.pd.opened import Dispatch
from router.pd.progress import Progress
from router.pd.relay_hooks import RelayHooks
from router.pd.sse import SSE_DONE
from router.pd.usage import MARKER
from router.registry import ModelPool

__all__ = ["MIGRATION", "STREAM", "Migration"]

MIGRATION = "migration"  # the phase of one continuation
STREAM = "stream"  # the phase of relaying one leg's stream

# Where a continuation goes (Migration._where).
_RULES, _PREFILL = "rules", "prefill_alone"


class Migration:
    """One client request relayed with migration (its ``count`` of continuations is read
    for the access log). Created per request by the relay, used once."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        pool: ModelPool,
        creq: ClientRequest,
        client_id: str,
        config: MigrationConfig,
    ) -> None:
        self._dispatcher, self._pool, self._creq = dispatcher, pool, creq
        self._client_id = client_id
        self._config, self._events = config, dispatcher.lifecycle
        self._progress = Progress.of(creq)
        self._whole = not creq.stream  # assembled here from D's stream (non_streamed)
        self._dispatched = with_token_ids(creq)  # what the first leg is asked
        self._request_id = "-"  # the first dispatch's, echoed when the client sent none
        self._sent = False  # a body message sent to the client
        self._failed = False  # ended with an error event
        self.count = 0

    async def run(self, hooks: RelayHooks) -> Outcome:
        """Relay the request to its end. Raises :class:`RouterError` only if its first
        dispatch could not open (nothing sent: the caller answers with the error)."""
        creq = self._dispatched
        async with self._dispatcher.dispatch(self._pool, creq, self._client_id) as d:
            hooks.opened(d)
            if d.leg.rest is None:
                return await hooks.as_is(d)
            self._request_id = d.request_id
            if not self._whole:
                await hooks.start(d.leg, d.request_id)
            avoid: set[Instance] = set()
            cut = await self._relay(d, hooks, avoid)
            avoid.add(d.leg.instance)
        while cut is not None:
            cut = await self._continue(cut, hooks, avoid)
        return Outcome.UPSTREAM_ERROR if self._failed else Outcome.SUCCESS

    async def _continue(self, cut: Cut, hooks: RelayHooks, avoid: set[Instance]) -> Cut | None:
        """Continue after ``cut`` on another engine, or end the stream: closed by the router
        if nothing is left to generate, with the cut's error where it cannot continue. A cut
        before any event reached the client starts the request over (a completion's prompt
        ids come with its first token: none came)."""
        progress = self._progress
        progress.settle()  # what the client received, recorded before it is read
        fresh = not progress.identity
        if not fresh and self._nothing_left():
            await self._close(hooks)
            return None
        where = self._where(avoid, fresh)
        if where is None:
            await self._fail(hooks, cut)
            return None
        self.count += 1
        self._events.migrated(self._pool.name, self._pool.mode, cut.cause)
        if fresh:
            creq = self._dispatched
        else:
            progress.legs += 1
            creq = continuation(self._dispatched, progress)
        attributes = {"pdrouter.migration": self.count, "pdrouter.cause": cut.cause}
        try:
            with self._events.phase(MIGRATION, attributes):
                async with self._dispatcher.dispatch(
                    self._pool, creq, self._client_id, frozenset(avoid), where is _PREFILL
                ) as d:
                    if d.leg.rest is None:  # cannot happen: the continuation streams
                        raise cut.error
                    next_cut = await self._relay(d, hooks, avoid)
                    avoid.add(d.leg.instance)
        except RouterError as exc:
            error = exc if isinstance(exc, UpstreamError) else cut.error
            await self._fail(hooks, Cut(cut.cause, error, cut.fault))
            return None
        return next_cut

    def _nothing_left(self) -> bool:
        """The client has the answer's last token (its final chunk or usage maybe not)."""
        p = self._progress
        return p.resumable and (p.finish_reason is not None or remaining(self._creq, p) == 0)

    def _where(self, avoid: set[Instance], fresh: bool) -> str | None:
        """Where the request may continue: ``_RULES`` (by the model's rules: a D it has not
        failed on is in rotation), ``_PREFILL`` (a P alone: no such D, a disaggregated
        model, ``prefill_alone`` on and a P it has not run on in rotation), None (nowhere)."""
        if self.count >= self._config.max_attempts or not (fresh or self._progress.resumable):
            return None
        pool, avoided = self._pool, frozenset(avoid)
        if pool.has_alternative(Role.DECODE.value, avoided):
            return _RULES
        alone = self._config.prefill_alone and pool.mode.uses_prefill
        if alone and pool.has_alternative(Role.PREFILL.value, avoided):
            return _PREFILL
        return None

    async def _relay(self, d: Dispatch, hooks: RelayHooks, avoid: set[Instance]) -> Cut | None:
        """Relay ``d``'s stream event by event until ``[DONE]`` (None: the answer is whole)
        or a cut (returned; nothing of the cut event was sent). ``avoid``: the engines this
        request failed on before (where it could not continue if D were ejected now)."""
        with self._events.phase(STREAM):
            cut = await self._relay_leg(d, hooks, avoid)
            if self._events.annotates:
                self._events.annotate({"pdrouter.chunks": d.leg.chunks})
                if cut is not None:
                    self._events.annotate({"pdrouter.cut": cut.cause})
            return cut

    async def _relay_leg(self, d: Dispatch, hooks: RelayHooks, avoid: set[Instance]) -> Cut | None:
        leg = d.leg
        watch = StallWatch(leg, self._config.stall_timeout, asyncio.get_running_loop())

        def ejected() -> None:
            # D left rotation ejected: move on now if the request can go elsewhere; with
            # nowhere to go, D's stream is still the client's best chance.
            if self._where(avoid | {leg.instance}, not self._progress.identity) is not None:
                watch.eject()

        with leg.instance.leaving(ejected):
            if leg.instance.ejected:  # while its first bytes came
                ejected()
            return await self._read_leg(d, hooks, watch)

    # The reads are inlined, not a generator, and the stall is watched by one timer per
    # stream: this loop runs once per read (an asyncio.timeout per read cost ~9 us). Once the
    # client has the first event, ordinary token events are spliced while it reads
    # (LegReading.take): written as they arrive, the loop woken only by any other read.
    async def _read_leg(self, d: Dispatch, hooks: RelayHooks, watch: StallWatch) -> Cut | None:
        leg, events, rest, progress = d.leg, SseEvents(), d.leg.rest, self._progress
        assert rest is not None
        loop = asyncio.get_running_loop()
        r = LegReading(leg, events, progress, watch, loop.time, d.usage_patch is not None)
        # A continuation's events are rewritten (Progress.relayed refuses them): no splice.
        splicing = None if self._whole or progress.legs != 1 else hooks.writer()
        data: bytes | None = leg.first
        try:
            while True:
                if data is None:  # D's end without [DONE], or the stream closed on a stall
                    return ended_early(leg, watch, r.count, r.worst)
                out, done, error = _client_bytes(progress, events, data)
                if d.usage_patch is not None and MARKER in out:
                    out = await d.usage_patch(out)
                if done:
                    watch.since = loop.time()  # D's end is read, but not forever
                    await self._finish(d, hooks, out, rest, r.count, r.worst)
                    return None
                if out and not self._whole:  # the events before an error event too
                    await self._send(hooks, out)
                if error is not None:
                    leg.read_ended(r.count, r.worst, Fault.ANSWER)
                    return cut(MigrationCause.ERROR_EVENT, leg, Fault.ANSWER, error)
                r.waiting()
                if splicing is not None and self._sent:  # again: a refused chunk ended it
                    r.writer = splicing if leg.stream.splice(r.take) else None
                    splicing = r.writer
                raw = await anext(rest, None)
                r.read()
                data = None if raw is None else leg.scrubbed(raw)
        except UpstreamError as exc:
            return self._broken(d, watch, r, exc)
        finally:
            if r.writer is not None:
                leg.stream.splice(None)
            watch.cancel()
            hooks.stream_stats(d)

    def _broken(self, d: Dispatch, watch: StallWatch, r: LegReading, exc: UpstreamError) -> Cut:
        """The cut of a leg whose stream broke (or was closed by the stall watch or an
        ejection)."""
        leg = d.leg
        if watch.fired or watch.ejected:
            return ended_early(leg, watch, r.count, r.worst)
        stalled = isinstance(exc, UpstreamTimeout)  # the transport's idle timeout
        leg.read_ended(r.count, r.worst, exc.fault)
        cause = MigrationCause.STALL if stalled else MigrationCause.DISCONNECT
        return Cut(cause, d.prefill_error or exc, exc.fault)

    async def _send(self, hooks: RelayHooks, body: bytes) -> None:
        if not self._sent:
            self._sent = True
            hooks.first_byte()
        await hooks.more(body)

    async def _finish(
        self,
        d: Dispatch,
        hooks: RelayHooks,
        out: bytes,
        rest: AsyncIterator[bytes],
        count: int,
        worst: float,
    ) -> None:
        """``[DONE]`` came: D's HTTP end is read (its connection reused) before the client
        gets the end, as a plain relay does; a failure there breaks no answer."""
        with contextlib.suppress(UpstreamError):
            async for _ in rest:
                pass
        d.leg.read_ended(count, worst, None)
        d.ended_cleanly()
        if self._whole:
            body = orjson.dumps(self._progress.whole())
            if d.usage_patch is not None and MARKER in body:
                body = await d.usage_patch(body)
            await hooks.whole(body, self._request_id)
            return
        if not self._sent:
            hooks.first_byte()
        await hooks.end(out + SSE_DONE)

    async def _close(self, hooks: RelayHooks) -> None:
        """End an answer whose last token the client has: its final chunk and usage, if
        they were not read before the cut, then ``[DONE]``."""
        if self._whole:
            await hooks.whole(orjson.dumps(self._progress.whole()), self._request_id)
            return
        events = self._progress.closing_events()
        body = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
        await hooks.end(body + SSE_DONE)

    async def _fail(self, hooks: RelayHooks, cut: Cut) -> None:
        """End the answer with the cut's error: an SSE error event, or for a non-streamed
        request (nothing sent yet) the error raised, answered as a whole error response."""
        err = cut.error
        self._failed = True
        if self._whole:
            raise err
        if cut.event is not None:
            await hooks.end(cut.event + SSE_DONE)
            return
        await hooks.end(sse_error_event(err.message, err.type, err.code))


def _client_bytes(
    progress: Progress, events: SseEvents, data: bytes
) -> tuple[bytes, bool, bytes | None]:
    """The client's bytes for a read of D's stream, as :meth:`Progress.client_bytes` says."""
    if not events.held and data.endswith(b"\n\n"):
        out = progress.relayed(data)  # one ordinary token event: most reads
        if out is not None:
            return out, False, None
    return progress.client_bytes(events.feed(data))
