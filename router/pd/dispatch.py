"""Dispatch one client request up to D's first bytes: slot first, then the legs.

Per attempt::

    reserve a decode slot (may queue)            -- before any upstream call
    pull:             P ──▶ params ──▶ D
    push (P known):   P ∥ D   (D gets P's coordinates; P drains in the background)
    push (P unknown), push-sequential:  P ──▶ identity ──▶ D
    pipelined:        P ∥ D   (each leg carries the other's identity)
    aggregated / short prompt / n>1:  D alone

An attempt that fails before the client has seen a byte is retried with fresh
ids on a re-selected pair, avoiding the failed instance. The returned
:class:`Dispatch` owns the slot, D's open stream and any background P leg until
:meth:`Dispatcher.finish` is called, which the caller must do exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.client_request import ClientRequest
from router.config import Mode, RetryConfig
from router.errors import Fault, NoHealthyEngine, UpstreamError
from router.metrics import Metrics
from router.pd import kv_params as kp
from router.pd import pipelined_params as pp
from router.pd.legs import DecodeLeg, LegRunner, PrefillResult
from router.pd.settle import Settler, cancel_task, discard_decode
from router.registry import ModelPool
from router.workers.breaker import BreakerState
from router.workers.instance import Instance, Role, candidates, refusal
from router.workers.ledger import Reservation

__all__ = ["Dispatch", "Dispatcher"]

log = logging.getLogger("pd_router.dispatch")

_PREFIX_KEY_CHARS = 256
_DISAGGREGATED = frozenset(m.value for m in Mode if m.uses_prefill)


@dataclass(eq=False)
class Dispatch:
    """An opened request: D's first bytes are in; the caller relays the rest."""

    pool: ModelPool
    reservation: Reservation
    leg: DecodeLeg
    decision: str
    request_id: str
    prefill_task: asyncio.Task[PrefillResult] | None = None
    prefill_done_at: float | None = None
    prefill_instance: Instance | None = None
    prefill_error: UpstreamError | None = None  # P failed after D's first bytes
    finished: bool = field(default=False)


def _decision(pool: ModelPool, creq: ClientRequest) -> str:
    if not pool.mode.uses_prefill:
        return "aggregated"
    if creq.n > 1:
        return "decode_only_n"
    threshold = pool.config.disagg_min_prompt_tokens
    if threshold and creq.estimated_prompt_tokens() < threshold:
        return "decode_only_short"
    return pool.mode.value


def _routing_key(creq: ClientRequest) -> str:
    body = creq.body
    if "messages" in body:
        return str(body["messages"])[:_PREFIX_KEY_CHARS]
    return str(body.get("prompt"))[:_PREFIX_KEY_CHARS]


class Dispatcher:
    def __init__(
        self,
        legs: LegRunner,
        metrics: Metrics,
        retries: RetryConfig,
        clock: Callable[[], float] = time.monotonic,
        probe_interval: float = 5.0,
    ) -> None:
        """``probe_interval``: the health-check interval (Retry-After of a refusal)."""
        self._probe_interval = probe_interval
        self._legs = legs
        self.metrics = self._metrics = metrics
        self.settler = Settler(legs.timeouts)
        self._retries = retries
        self._clock = clock

    async def open(self, pool: ModelPool, creq: ClientRequest, client_id: str = "-") -> Dispatch:
        """Reserve, dispatch and return once D's first bytes are in; retries inside.

        A failed attempt is retried only where a retry can help: the error is
        retryable and another instance of the failing role is in rotation (a
        timeout or refusal is never retried on the same, only engine). Raises a
        :class:`~router.errors.RouterError` when no attempt succeeded.
        ``client_id`` (the client's X-Request-Id) appears in log lines only.
        """
        decision = _decision(pool, creq)
        self._metrics.decisions.labels(pool.name, decision).inc()
        key = _routing_key(creq) if pool.key_needed else None
        avoid: frozenset[Instance] = frozenset()
        attempts = self._retries.max_attempts
        for attempt in range(1, attempts + 1):
            try:
                return await self._attempt(pool, creq, decision, key, avoid)
            except UpstreamError as exc:
                self._metrics.upstream_errors.labels(pool.name, exc.role, str(exc.code)).inc()
                avoid = avoid | {i for i in _all(pool) if i.url == exc.instance}
                retry = (
                    exc.retryable and attempt < attempts and pool.has_alternative(exc.role, avoid)
                )
                log.warning(
                    "event=attempt_failed request_id=%s client_id=%s attempt=%d role=%s "
                    "instance=%s reason=%r cause=%r retry=%s",
                    exc.request_id,
                    client_id,
                    attempt,
                    exc.role,
                    exc.instance,
                    exc.message,
                    str(exc.__cause__ or exc.code),
                    "yes" if retry else "no",
                )
                if not retry:
                    raise
                self._metrics.retries.labels(pool.name).inc()
                await asyncio.sleep(self._backoff(attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def _no_prefill(self, pool: ModelPool) -> NoHealthyEngine:
        return refusal(Role.PREFILL, pool.name, pool.prefill, self._clock(), self._probe_interval)

    def _backoff(self, attempt: int) -> float:
        r = self._retries
        base = min(r.backoff_max, r.backoff_initial * (2.0 ** (attempt - 1)))
        jitter: float = random.uniform(0.8, 1.2)
        return base * jitter

    async def _attempt(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        decision: str,
        key: str | None,
        avoid: frozenset[Instance],
    ) -> Dispatch:
        if decision in _DISAGGREGATED and not candidates(pool.prefill):
            # Refused before a decode slot is taken: no queue wait can end well.
            raise self._no_prefill(pool)
        reservation = await pool.ledger.reserve(key, avoid)
        ids = kp.new_dispatch_ids()
        try:
            if decision not in _DISAGGREGATED:
                body = kp.aggregated_body(creq.body)
                leg = await self._decode(pool, reservation, creq, body, ids)
                return Dispatch(pool, reservation, leg, decision, ids.request_id)
            prefill = pool.select_prefill(key, avoid)
            if prefill is None:  # left rotation while this request waited for its slot
                raise self._no_prefill(pool)
            return await self._by_mode(pool, creq, reservation, prefill, ids)
        except BaseException as exc:
            if isinstance(exc, UpstreamError):
                exc.request_id = ids.request_id  # for the attempt's log line
            if not reservation.detached:
                pool.ledger.release(reservation)
            raise

    async def _by_mode(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        res: Reservation,
        p: Instance,
        ids: kp.DispatchIds,
    ) -> Dispatch:
        mode = pool.mode
        if mode is Mode.PULL:
            return await self._pull(pool, creq, res, p, ids)
        if mode is Mode.PIPELINED:
            return await self._pipelined(pool, creq, res, p, ids)
        identity = pool.identities.get(p.url)
        if mode is Mode.PUSH_SEQUENTIAL or identity is None:
            if mode is Mode.PUSH:
                self._metrics.push_fallbacks.labels(pool.name).inc()
            return await self._push_sequential(pool, creq, res, p, ids)
        d_params = kp.push_decode_params(
            identity,
            kp.predicted_prefill_request_id(creq.endpoint, ids.request_id),
            ids.transfer_id,
        )
        return await self._concurrent(
            pool, creq, res, p, ids, d_params, kp.prefill_params(ids.transfer_id)
        )

    # -- modes ---------------------------------------------------------------

    async def _pull(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        res: Reservation,
        p: Instance,
        ids: kp.DispatchIds,
    ) -> Dispatch:
        def params(p_params: dict[str, Any]) -> dict[str, Any]:
            return kp.pull_decode_params(p_params, ids.transfer_id, pool.kv_hosts.get(p.url))

        return await self._sequential(pool, creq, res, p, ids, params)

    async def _push_sequential(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        res: Reservation,
        p: Instance,
        ids: kp.DispatchIds,
    ) -> Dispatch:
        def params(p_params: dict[str, Any]) -> dict[str, Any]:
            identity = kp.identity_from_params(p_params, pool.kv_hosts.get(p.url))
            if identity is None:
                raise UpstreamError(
                    "prefill engine returned kv_transfer_params without its NIXL identity",
                    role="prefill",
                    instance=p.url,
                    code="kv_transfer_params_incomplete",
                )
            pool.learn_identity(p.url, identity)
            remote_id = p_params.get("remote_request_id")
            if not isinstance(remote_id, str):
                remote_id = kp.predicted_prefill_request_id(creq.endpoint, ids.request_id)
            return kp.push_decode_params(identity, remote_id, ids.transfer_id)

        return await self._sequential(pool, creq, res, p, ids, params)

    async def _sequential(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        res: Reservation,
        p: Instance,
        ids: kp.DispatchIds,
        decode_params: Callable[[dict[str, Any]], dict[str, Any]],
    ) -> Dispatch:
        """P to completion, then D with parameters derived from P's response."""
        result = await self._prefill(pool, creq, p, ids, kp.prefill_params(ids.transfer_id))
        assert result.kv_params is not None  # required in these modes (legs.prefill)
        d_params = decode_params(result.kv_params)
        leg = await self._decode(pool, res, creq, kp.decode_body(creq.body, d_params), ids)
        return self._opened(pool, res, leg, ids, p, None, result.finished_at)

    async def _pipelined(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        res: Reservation,
        p: Instance,
        ids: kp.DispatchIds,
    ) -> Dispatch:
        d_identity, p_identity = res.instance.peer, p.peer
        for inst, ident in ((res.instance, d_identity), (p, p_identity)):
            if ident is None:  # config validation requires it; discovery may not know it
                raise UpstreamError(
                    f"{inst.role} engine has no NIXL identity for pipelined mode",
                    role=inst.role.value,
                    instance=inst.url,
                    code="nixl_identity_missing",
                    fault=Fault.NONE,
                )
        assert d_identity is not None and p_identity is not None
        return await self._concurrent(
            pool,
            creq,
            res,
            p,
            ids,
            dict(pp.decode_params(ids.transfer_id, p_identity)),
            dict(pp.prefill_params(ids.transfer_id, d_identity)),
        )

    async def _concurrent(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        res: Reservation,
        p: Instance,
        ids: kp.DispatchIds,
        d_params: dict[str, Any],
        p_params: dict[str, Any],
    ) -> Dispatch:
        """Both legs at once. If P fails first, D is closed and P's error surfaces;
        if D answers first, P keeps draining in the background."""
        p_task = asyncio.create_task(self._prefill(pool, creq, p, ids, p_params))
        d_task = asyncio.create_task(
            self._decode(pool, res, creq, kp.decode_body(creq.body, d_params), ids)
        )
        try:
            done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            p_error = p_task.exception() if p_task in done else None
            d_ok = d_task in done and d_task.exception() is None
            if p_error is not None and not d_ok:
                await discard_decode(d_task)
                self._after_prefill_failure(pool, p, res.instance)
                raise p_error
            leg = await d_task
        except asyncio.CancelledError:
            if pool.mode is Mode.PUSH and not p_task.done() and not d_task.done():
                self._hand_over(pool, res, p, p_task, d_task, creq.stream)
            else:
                await discard_decode(d_task)
                await cancel_task(p_task)
            raise
        except BaseException:
            delivered = p_task.done() and not p_task.cancelled() and p_task.exception() is None
            await discard_decode(d_task)
            await cancel_task(p_task)
            if pool.mode is Mode.PUSH and not delivered:
                # D failed before P delivered (e.g. D's first-byte timeout while P
                # hangs): closed while it waited for KV, it may leak like above.
                res.instance.suspect = True
            # The failed task holds the exception, whose traceback holds this frame:
            # without these locals that is not a cycle (which only the collector frees).
            del p_task, d_task
            p_error, done = None, set()
            raise
        finished_at = None
        if p_task.done() and p_task.exception() is None:
            finished_at = p_task.result().finished_at
            self._refresh_identity(pool, p, p_task.result())
        return self._opened(pool, res, leg, ids, p, p_task, finished_at)

    def _hand_over(
        self,
        pool: ModelPool,
        res: Reservation,
        p: Instance,
        p_task: asyncio.Task[PrefillResult],
        d_task: asyncio.Task[DecodeLeg],
        streaming: bool,
    ) -> None:
        res.detached = True  # the settler releases it once D is closed

        def release() -> None:
            pool.ledger.release(res)

        def on_leak() -> None:
            self._after_prefill_failure(pool, p, res.instance)

        self.settler.settle_push(p_task, d_task, streaming, release, on_leak)

    # -- helpers -------------------------------------------------------------

    async def _prefill(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        p: Instance,
        ids: kp.DispatchIds,
        params: dict[str, Any],
    ) -> PrefillResult:
        started = self._clock()
        try:
            result = await self._legs.prefill(
                pool.name,
                p,
                creq.endpoint.value,
                kp.prefill_body(creq.body, params),
                ids.request_id,
                require_params=pool.mode is not Mode.PIPELINED,
            )
        except UpstreamError as exc:
            pool.record(p, exc.fault)
            raise
        else:
            pool.record(p, None)
            return result
        finally:
            self._metrics.prefill_duration.labels(pool.name, pool.mode.value).observe(
                self._clock() - started
            )

    async def _decode(
        self,
        pool: ModelPool,
        res: Reservation,
        creq: ClientRequest,
        body: dict[str, Any],
        ids: kp.DispatchIds,
    ) -> DecodeLeg:
        """Open D's leg. A leg is judged when it ends (:meth:`finish`), except a
        half-open D's trial, which succeeds with its first bytes: the other
        requests need not wait for the whole stream to know that D is back."""
        d = res.instance
        try:
            leg = await self._legs.open_decode(
                d, creq.endpoint.value, body, ids.request_id, creq.stream
            )
        except UpstreamError as exc:
            pool.record(d, exc.fault)
            raise
        if d.breaker.state is BreakerState.HALF_OPEN:
            pool.record(d, None)
        return leg

    def _opened(
        self,
        pool: ModelPool,
        res: Reservation,
        leg: DecodeLeg,
        ids: kp.DispatchIds,
        p: Instance,
        p_task: asyncio.Task[PrefillResult] | None,
        prefill_done_at: float | None,
    ) -> Dispatch:
        if prefill_done_at is not None:
            self._metrics.handoff.labels(pool.name, pool.mode.value).observe(
                max(0.0, self._clock() - prefill_done_at)
            )
        dispatch = Dispatch(
            pool, res, leg, pool.mode.value, ids.request_id, p_task, prefill_done_at, p
        )
        if p_task is not None and not p_task.done():
            p_task.add_done_callback(lambda t: self._on_late_prefill(dispatch, t))
        return dispatch

    def _on_late_prefill(self, dispatch: Dispatch, task: asyncio.Task[PrefillResult]) -> None:
        """P failed while D was already streaming: end D so the client sees the error."""
        if task.cancelled() or dispatch.finished:
            return
        exc = task.exception()
        if isinstance(exc, UpstreamError):
            dispatch.prefill_error = exc
            self.settler.spawn(dispatch.leg.stream.aclose())
        elif exc is None and dispatch.prefill_instance is not None:
            self._refresh_identity(dispatch.pool, dispatch.prefill_instance, task.result())

    def _after_prefill_failure(self, pool: ModelPool, p: Instance, d: Instance) -> None:
        pool.forget_identity(p.url)
        if pool.mode is Mode.PUSH:
            # vLLM 0.32's push connector leaks a D request closed while it waits for
            # KV; the health monitor checks this D's own metrics before trusting it.
            d.suspect = True

    def _refresh_identity(self, pool: ModelPool, p: Instance, result: PrefillResult) -> None:
        if pool.mode is Mode.PUSH and result.kv_params is not None:
            identity = kp.identity_from_params(result.kv_params, pool.kv_hosts.get(p.url))
            if identity is not None:
                pool.learn_identity(p.url, identity)

    async def finish(self, dispatch: Dispatch, fault: Fault | None) -> None:
        """Release everything the dispatch holds; exactly once, on every exit path.

        ``fault`` is how D's stream ended: None (it completed), ``Fault.ENGINE`` (it
        broke), ``Fault.ANSWER`` (D's own error event), ``Fault.NONE`` (the client
        left: no verdict). A P leg still running is drained when the request
        succeeded, cancelled otherwise.
        """
        if dispatch.finished:
            return
        dispatch.finished = True
        leg = dispatch.leg
        try:
            await leg.close()
        finally:
            dispatch.pool.ledger.release(dispatch.reservation)
        dispatch.pool.record(leg.instance, fault)
        task = dispatch.prefill_task
        if task is not None and not task.done():
            if fault is None:
                await asyncio.gather(task, return_exceptions=True)
            else:
                await cancel_task(task)
        if task is not None and task.done() and not task.cancelled() and task.exception():
            log.warning(
                "event=late_prefill_failure request_id=%s reason=%r",
                dispatch.request_id,
                str(task.exception()),
            )


def _all(pool: ModelPool) -> list[Instance]:
    return [*pool.prefill, *pool.decode]
