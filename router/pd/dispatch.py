"""Dispatch one client request up to D's first bytes: slot first, then the plan's legs.

Per attempt: reserve a decode slot (may queue; before any upstream call), select P,
run the decision's plan (``router/pd/plans.py``) sequentially or concurrently, and
open D's stream. A model with ``adaptive`` on may serve a request by D alone or P alone
instead (``router/pd/adaptive.py``); P alone holds no decode slot. An attempt that fails
before the client has seen a byte is retried with fresh ids on a re-selected pair,
avoiding the failed instance.

:meth:`Dispatcher.dispatch` is an ``async with``: it is entered once D's first bytes
are in, and its exit releases everything the request holds (the slot, D's stream,
a P leg still running) and judges D by the leg's verdict, on every exit path.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace
from typing import Any

from router.client_request import ClientRequest
from router.config import RetryConfig, TracingConfig, split_engine_key
from router.engines.adapter_loads import AdapterLoader
from router.engines.adapters import requested_adapter
from router.engines.affinity import Placement
from router.engines.breaker import BreakerState
from router.engines.instance import Instance, Role, candidates, refusal
from router.engines.ledger import Deadline, Reservation
from router.errors import (
    DeadlineExceeded,
    Fault,
    NoCapacity,
    NoHealthyEngine,
    QueueFull,
    UpstreamError,
    UpstreamStatus,
)
from router.kvindex.route import CacheRoute, CacheScorer, Result
from router.metrics import Metrics
from router.pd import adaptive
from router.pd import kv_params as kp
from router.pd.kept_turns import KeptTurns, TurnPlan
from router.pd.legs import DecodeLeg, LegRunner, PrefillResult
from router.pd.opened import Dispatch
from router.pd.plans import Decision, Pair, Plan, decide, plans
from router.pd.routing import Route, prefill_busy, routing_key
from router.pd.settle import Settler, cancel_task, discard_decode
from router.registry import ModelPool
from router.tracing import Tracing

__all__ = ["Dispatcher", "Pick"]

log = logging.getLogger("pd_router.dispatch")


@dataclass(frozen=True, slots=True)
class Pick:
    """What :meth:`Dispatcher.pick` chose: the decision, the decode slot held (None: P
    alone), its D and the P to pair with it (None where the decision uses none)."""

    decision: Decision
    reservation: Reservation | None
    decode: Instance | None
    prefill: Instance | None


class Dispatcher:
    def __init__(
        self,
        legs: LegRunner,
        turns: KeptTurns,
        metrics: Metrics,
        retries: RetryConfig,
        clock: Callable[[], float] = time.monotonic,
        probe_interval: float = 5.0,
        tracing: Tracing | None = None,
        scorer: CacheScorer | None = None,
        adapters: AdapterLoader | None = None,
    ) -> None:
        """``probe_interval``: the health-check interval (Retry-After of a refusal).
        ``scorer``: cache-aware routing for models with ``kv_events`` on. ``adapters``:
        loads a model's ``lora.modules`` on the chosen engines that lack them."""
        self._adapters = adapters
        self._tracing = tracing or Tracing(TracingConfig())
        self._scorer = scorer
        self._probe_interval = probe_interval
        self._legs = legs
        self._metrics = metrics
        self.settler = Settler(legs.timeouts)
        self._turns = turns
        self._retries = retries
        self._clock = clock
        self._plans: dict[Decision, Plan] = plans(
            self.settler, lambda model: metrics.push_fallbacks.labels(model).inc()
        )

    def dispatch(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        client_id: str = "-",
        avoid: frozenset[Instance] = frozenset(),
        prefill_alone: bool = False,
    ) -> AbstractAsyncContextManager[Dispatch]:
        """Reserve, dispatch and enter once D's first bytes are in; retries inside.

        A failed attempt is retried only where a retry can help: the error is
        retryable and another instance of the failing role is in rotation (a
        timeout or refusal is never retried on the same, only engine). Raises a
        :class:`~router.errors.RouterError` when no attempt succeeded; nothing is
        held then. The exit releases everything (see module doc).
        ``client_id`` (the client's X-Request-Id) appears in log lines only. ``avoid``:
        engines to keep away from from the first attempt on, where others can serve (a
        migrated request's failed D, router/pd/migration.py). ``prefill_alone``: served by a P
        alone whatever the mode's rules (a migrated request whose only D failed).
        """
        return _Dispatching(self, pool, creq, client_id, avoid, prefill_alone)

    async def _open(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        client_id: str,
        avoid: frozenset[Instance] = frozenset(),
        prefill_alone: bool = False,
    ) -> Dispatch:
        decision, route = await self._route(pool, creq, prefill_alone)
        attempts = self._retries.max_attempts
        for attempt in range(1, attempts + 1):
            try:
                with self._tracing.span("attempt", {"pdrouter.attempt": attempt}):
                    return await self._attempt(pool, creq, decision, route, avoid)
            except UpstreamError as exc:
                self._metrics.upstream_errors.labels(pool.name, exc.role, str(exc.code)).inc()
                avoid = avoid | _failed(pool, exc)
                retry = (
                    exc.retryable and attempt < attempts and pool.has_alternative(exc.role, avoid)
                )
                _log_failed_attempt(exc, client_id, attempt, retry)
                if not retry:
                    raise
                self._metrics.retries.labels(pool.name).inc()
                self._tracing.set(pdrouter__retries=attempt)
                await asyncio.sleep(self._backoff(attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    async def _route(
        self, pool: ModelPool, creq: ClientRequest, prefill_alone: bool = False
    ) -> tuple[Decision, Route]:
        """The request's decision (counted) and what selection goes by. A request an endpoint
        picker already placed (``creq.picked_decision``, a ``pd-router sidecar``'s) keeps the
        picker's decision, and its P is the one the picker named. ``prefill_alone``: a
        migration's continuation with no other D to go to, which P serves alone."""
        cfg = pool.config
        if prefill_alone:
            decision = Decision.PREFILL_ALONE
        elif creq.picked_decision is not None:
            decision = Decision(creq.picked_decision)
        else:
            decision = decide(pool.mode, creq, cfg.disagg_min_prompt_tokens, prefill_busy(pool))
            decision = self._adapt(pool, creq, decision)
        self._metrics.decisions.labels(pool.name, decision).inc()
        if self._tracing.enabled:
            self._tracing.set(pdrouter__decision=decision.value)
        # The key is built at most once, and only if the policy or the session fallback needs it.
        key = routing_key(creq) if pool.key_needed else None
        session = pool.session_key(creq.session, lambda: key or routing_key(creq))
        # A LoRA adapter's request: only engines that hold it (router/engines/adapters.py).
        adapter = requested_adapter(pool.name, creq.body)
        prefill_ok = pool.adapter_filter(adapter, Role.PREFILL, paired=True)
        decode_ok = pool.adapter_filter(adapter, Role.DECODE, paired=decision.uses_prefill)
        if creq.picked_prefill is not None:
            prefill_ok = _only(creq.picked_prefill, prefill_ok)
        if creq.picked_rank is not None:
            decode_ok = _rank_only(creq.picked_rank, decode_ok)
        route = Route(key, session, await self._cache_route(pool, creq), prefill_ok, decode_ok)
        return decision, route

    async def pick(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        reachable: Callable[[Instance], bool] | None = None,
    ) -> Pick:
        """An endpoint picker's choice (router/picker): the decision, a decode slot reserved
        first (may queue) and the P to pair with it, by the same rules as :meth:`dispatch`,
        and no engine called. ``reachable``: the engines the gateway may send this request
        to (its D, or its P when P serves alone; None: any). The caller gives the slot back
        with :meth:`unpick` once the gateway reports the response's end. Raises the
        :class:`~router.errors.RouterError` that refuses the request (nothing is held then)."""
        decision, route = await self._route(pool, creq)
        if reachable is not None:
            decode_ok = _both(route.decode_ok, reachable)
            if decision is Decision.PREFILL_ALONE:
                route = replace(route, prefill_ok=_both(route.prefill_ok, reachable))
            route = replace(route, decode_ok=decode_ok)
        usable = candidates(pool.prefill) if decision.uses_prefill else []
        if decision.uses_prefill and not [p for p in usable if _ok(route.prefill_ok, p)]:
            raise self._no_prefill(pool)
        if decision is Decision.PREFILL_ALONE:
            lease = pool.select_prefill(
                route.key, frozenset(), route.session, route.cache, allowed=route.prefill_ok
            )
            if lease is None:
                raise self._no_prefill(pool)
            self._count_placement(pool, Role.PREFILL, lease.placement)
            return Pick(decision, None, None, lease.instance)
        reservation = await self._reserve(pool, creq, route, frozenset())
        if not decision.uses_prefill:
            return Pick(decision, reservation, reservation.instance, None)
        d = reservation.instance
        lease = pool.select_prefill(
            route.key, frozenset(), route.session, route.cache, decode=d, allowed=route.prefill_ok
        )
        if lease is None:
            pool.ledger.release(reservation)
            raise self._no_prefill(pool, d)
        self._count_placement(pool, Role.PREFILL, lease.placement)
        self._count_choice(pool, Role.PREFILL, route.cache)
        return Pick(decision, reservation, d, lease.instance)

    def unpick(self, pool: ModelPool, pick: Pick) -> None:
        """Give back what :meth:`pick` holds (idempotent): the decode slot."""
        if pick.reservation is not None:
            pool.ledger.release(pick.reservation)

    def _adapt(self, pool: ModelPool, creq: ClientRequest, decision: Decision) -> Decision:
        """The adaptive rule's decision for a request the model's mode would split (counted);
        ``decision`` as it is otherwise, or when the model has the rule off."""
        cfg = pool.config.adaptive
        if not cfg.enabled or decision.value != pool.mode.value:
            return decision
        choice = adaptive.decide(cfg, pool, creq.estimated_prompt_tokens(), self._clock())
        self._metrics.route_choices.labels(pool.name, choice).inc()
        return _ADAPTED.get(choice, decision)

    def _count_placement(self, pool: ModelPool, role: Role, placement: Placement | None) -> None:
        if placement is not None:
            self._metrics.session_routes.labels(pool.name, role.value, placement).inc()

    async def _cache_route(self, pool: ModelPool, creq: ClientRequest) -> CacheRoute | None:
        """The request's cache-aware route (router/kvindex/route.py), if its model has one."""
        if self._scorer is None or not pool.config.kv_events.enabled:
            return None
        started = self._clock()
        route = await self._scorer.route(pool, creq)
        self._metrics.cache_tokenize.labels(pool.name).observe(self._clock() - started)
        return route

    def _count_choice(self, pool: ModelPool, role: Role, cache: CacheRoute | None) -> None:
        """Count how cache-aware routing chose ``role``'s engine, and what it predicted."""
        if cache is None:
            if pool.config.kv_events.enabled:
                self._metrics.cache_routes.labels(pool.name, role.value, Result.NO_TOKENS).inc()
            return
        result = cache.results.get(role)
        if result is None:
            return
        self._metrics.cache_routes.labels(pool.name, role.value, result).inc()
        predicted = cache.predicted.get(role)
        if predicted is not None and result is not Result.UNKNOWN:
            self._metrics.cache_predicted.labels(pool.name, role.value).observe(predicted)
            self._metrics.cache_prompt_tokens.labels(pool.name, role.value).inc(len(cache.tokens))
            if self._tracing.enabled:
                self._tracing.set(**{f"pdrouter__cached_{role.value}": predicted})

    def _no_prefill(self, pool: ModelPool, d: Instance | None = None) -> NoHealthyEngine:
        """No P in rotation; or, given D, none of those in rotation pairs with it (its
        partners are out: the engines of other versions serve other Ds)."""
        if d is not None and candidates(pool.prefill):
            why = f"none in rotation pairs with decode engine {d.key} ({d.facts.describe()})"
            return NoHealthyEngine(Role.PREFILL.value, pool.name, self._probe_interval, why)
        return refusal(Role.PREFILL, pool.name, pool.prefill, self._clock(), self._probe_interval)

    async def _load_adapter(self, pool: ModelPool, creq: ClientRequest, *engines: Instance) -> None:
        """The request's LoRA adapter, where the router loads it itself (``lora.modules``),
        loaded on those of the chosen ``engines`` that lack it (router/engines/
        adapter_loads.py); raises :class:`~router.errors.AdapterLoadFailed`."""
        adapter = requested_adapter(pool.name, creq.body)
        lora = pool.config.lora
        path = lora.modules.get(adapter) if adapter is not None else None
        if adapter is None or path is None or self._adapters is None:
            return
        await self._adapters.ensure(pool.name, adapter, path, engines, lora.load_timeout)

    def _backoff(self, attempt: int) -> float:
        r = self._retries
        base = min(r.backoff_max, r.backoff_initial * (2.0 ** (attempt - 1)))
        jitter: float = random.uniform(0.8, 1.2)
        return base * jitter

    async def _attempt(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        decision: Decision,
        route: Route,
        avoid: frozenset[Instance],
    ) -> Dispatch:
        usable = candidates(pool.prefill) if decision.uses_prefill else []
        if decision.uses_prefill and not [p for p in usable if _ok(route.prefill_ok, p)]:
            # Refused before a decode slot is taken: no queue wait can end well. (An adapter
            # whose holders are all out: no P for it, whatever the other Ps.)
            raise self._no_prefill(pool)
        if decision is Decision.PREFILL_ALONE:
            return await self._prefill_alone(pool, creq, route, avoid)
        reservation = await self._reserve(pool, creq, route, avoid)
        ids = kp.new_dispatch_ids()
        if self._tracing.enabled:
            self._tracing.set(
                pdrouter__decode=reservation.instance.key,
                pdrouter__request_id=ids.request_id,
                pdrouter__transfer_id=ids.transfer_id,
            )
        try:
            if decision.uses_prefill:
                return await self._split(pool, creq, decision, route, avoid, reservation, ids)
            await self._load_adapter(pool, creq, reservation.instance)
            body = kp.aggregated_body(creq.body)
            leg = await self._decode(pool, reservation.instance, creq, body, ids, alone=True)
            return Dispatch(reservation, leg, decision, ids.request_id)
        except BaseException as exc:
            if isinstance(exc, UpstreamError):
                exc.request_id = ids.request_id  # for the attempt's log line
            if not reservation.detached:
                pool.ledger.release(reservation)
            raise

    async def _prefill_alone(
        self, pool: ModelPool, creq: ClientRequest, route: Route, avoid: frozenset[Instance]
    ) -> Dispatch:
        """P serves the whole request as an aggregated engine (the client's body, no
        ``kv_transfer_params``); no decode slot is taken, D does no work for it."""
        lease = pool.select_prefill(
            route.key, avoid, route.session, route.cache, allowed=route.prefill_ok
        )
        if lease is None:
            raise self._no_prefill(pool)
        p = lease.instance
        self._count_placement(pool, Role.PREFILL, lease.placement)
        self._count_choice(pool, Role.PREFILL, route.cache)
        ids = kp.new_dispatch_ids()
        if self._tracing.enabled:
            self._tracing.set(pdrouter__prefill=p.key, pdrouter__request_id=ids.request_id)
        try:
            await self._load_adapter(pool, creq, p)
            body = kp.aggregated_body(creq.body)
            leg = await self._decode(pool, p, creq, body, ids, alone=True)
        except UpstreamError as exc:
            exc.request_id = ids.request_id  # for the attempt's log line
            raise
        return Dispatch(None, leg, Decision.PREFILL_ALONE, ids.request_id, prefill=p.key)

    async def _reserve(
        self, pool: ModelPool, creq: ClientRequest, route: Route, avoid: frozenset[Instance]
    ) -> Reservation:
        """A decode slot (may queue: the wait is the key's queue-wait metric)."""
        waited_from = self._clock()
        with self._tracing.span("slot_wait"):
            try:
                reservation = await pool.ledger.reserve(
                    route.key,
                    avoid,
                    route.session,
                    creq.client_key,
                    route.cache,
                    creq.priority_level,
                    _deadline(pool, creq),
                    route.decode_ok,
                )
            except (NoCapacity, QueueFull) as exc:
                self._count_refusal(pool, creq, exc)
                raise
        waited = self._clock() - waited_from
        self._metrics.key_queue_wait.labels(creq.client_key).observe(waited)
        self._metrics.class_queue_wait.labels(pool.name, creq.priority_class or "-").observe(waited)
        self._count_placement(pool, Role.DECODE, reservation.placement)
        self._count_choice(pool, Role.DECODE, route.cache)
        return reservation

    def _count_refusal(
        self, pool: ModelPool, creq: ClientRequest, exc: NoCapacity | QueueFull
    ) -> None:
        cls = creq.priority_class or "-"
        self._metrics.class_refusals.labels(pool.name, cls, exc.code).inc()
        if isinstance(exc, DeadlineExceeded):
            self._metrics.deadline_misses.labels(pool.name, cls).inc()

    async def _split(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        decision: Decision,
        route: Route,
        avoid: frozenset[Instance],
        reservation: Reservation,
        ids: kp.DispatchIds,
    ) -> Dispatch:
        """A disaggregated attempt, its decode slot held: select a P that can pair with its
        D, run the plan."""
        d = reservation.instance
        lease = pool.select_prefill(
            route.key, avoid, route.session, route.cache, decode=d, allowed=route.prefill_ok
        )
        if lease is None:  # left rotation while this request waited for its slot
            raise self._no_prefill(pool, d)
        p = lease.instance
        self._count_placement(pool, Role.PREFILL, lease.placement)
        self._count_choice(pool, Role.PREFILL, route.cache)
        await self._load_adapter(pool, creq, p, d)
        pair = Pair(creq, ids, p, reservation.instance)
        self._tracing.set(pdrouter__prefill=p.key)
        plan = self._plans[decision]
        turn = self._turns.plan(pool, creq, route.cache, reservation.instance)
        if plan.concurrent(pair):
            return await self._concurrent(pool, plan, pair, decision, reservation, turn)
        return await self._sequential(pool, plan, pair, decision, reservation, turn)

    async def _sequential(
        self,
        pool: ModelPool,
        plan: Plan,
        pair: Pair,
        decision: Decision,
        res: Reservation,
        turn: TurnPlan | None = None,
    ) -> Dispatch:
        """P to completion, then D with parameters derived from P's response; with a
        ``turn`` (router/pd/kept_turns.py), P may read the conversation's kept turn from D,
        and D's answer may be kept for the next one."""
        result = await self._prefill_turn(pool, plan, pair, turn)
        assert result.kv_params is not None  # required by sequential plans (legs.prefill)
        body = kp.decode_body(pair.creq.body, plan.decode_params(pair, result.kv_params))
        plan.prefill_done(pair, result)
        body = self._turns.decode_body(turn, body)
        leg = await self._decode(pool, pair.decode, pair.creq, body, pair.ids)
        self._turns.keep(pool, pair.creq, turn, leg, result.prompt_ids)
        self._observe_handoff(pool, result.finished_at)
        return Dispatch(
            res, leg, decision, pair.ids.request_id, prefill=pair.prefill.key, prefill_result=result
        )

    async def _prefill_turn(
        self, pool: ModelPool, plan: Plan, pair: Pair, turn: TurnPlan | None
    ) -> PrefillResult:
        """P's leg, reading the kept turn from D where it matches. If P fails with it (D
        freed it early, the read failed), P is asked once more without it."""
        params = plan.prefill_params(pair)
        if turn is None:
            return await self._prefill(pool, plan, pair, params)
        await self._turns.prepare(pool, pair.creq, pair.prefill, turn)
        ids = turn.streamed  # a streamed turn is kept with the prompt's ids, from P
        if turn.reuse is None:
            return await self._prefill(pool, plan, pair, params, ids)
        try:
            return await self._prefill(pool, plan, pair, {**params, **turn.reuse}, ids)
        except UpstreamStatus as exc:
            log.warning(
                "event=kept_turn_failed request_id=%s engine=%s status=%d",
                pair.ids.request_id,
                pair.prefill.key,
                exc.status,
            )
            return await self._prefill(pool, plan, pair, params, ids)

    async def _concurrent(
        self,
        pool: ModelPool,
        plan: Plan,
        pair: Pair,
        decision: Decision,
        res: Reservation,
        turn: TurnPlan | None = None,
    ) -> Dispatch:
        """Both legs at once. If P fails first, D is closed and P's error surfaces;
        if D answers first, P keeps running and is watched (see :meth:`_watch_prefill`).
        With a ``turn`` (pipelined, router/pd/kept_turns.py), P is handed the conversation's
        kept turn and D keeps this one once its answer ends cleanly."""
        p_params = plan.prefill_params(pair)
        d_params = plan.decode_params(pair, None)
        on_clean_end = None
        if turn is not None:
            p_params = {**p_params, **(self._turns.offer(pool, turn, pair.prefill) or {})}
            d_params = {**d_params, "keep_turn": self._turns.keep_value(turn)}
            tid, d = pair.ids.transfer_id, pair.decode
            on_clean_end = functools.partial(self._turns.kept, pool, turn, tid, d)
        d_body = kp.decode_body(pair.creq.body, d_params)
        leg, p_task = await self._race(pool, plan, pair, res, p_params, d_body)
        opened = Dispatch(
            res,
            leg,
            decision,
            pair.ids.request_id,
            p_task,
            prefill=pair.prefill.key,
            on_clean_end=on_clean_end,
        )
        if not p_task.done():
            p_task.add_done_callback(lambda t: self._watch_prefill(opened, plan, pair, t))
        elif p_task.exception() is None:
            plan.prefill_done(pair, p_task.result())
            self._observe_handoff(pool, p_task.result().finished_at)
        return opened

    async def _race(
        self,
        pool: ModelPool,
        plan: Plan,
        pair: Pair,
        res: Reservation,
        p_params: dict[str, Any],
        d_body: dict[str, Any],
    ) -> tuple[DecodeLeg, asyncio.Task[PrefillResult]]:
        """Start both legs; return D's once its first bytes are in, with P's task (maybe
        still running). On any failure neither leg is left running, unless the plan took
        both over (the client left: :meth:`Plan.abandon`)."""
        p_task = asyncio.create_task(self._prefill(pool, plan, pair, p_params))
        d_task = asyncio.create_task(self._decode(pool, pair.decode, pair.creq, d_body, pair.ids))
        try:
            done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            p_error = p_task.exception() if p_task in done else None
            d_ok = d_task in done and d_task.exception() is None
            if p_error is not None and not d_ok:
                await discard_decode(d_task)
                plan.prefill_failed_first(pair)
                raise p_error
            return await d_task, p_task
        except asyncio.CancelledError:
            await _client_left(pool, plan, pair, res, p_task, d_task)
            raise
        except BaseException:
            delivered = p_task.done() and not p_task.cancelled() and p_task.exception() is None
            await discard_decode(d_task)
            await cancel_task(p_task)
            plan.decode_failed(pair, delivered)
            # The failed task holds the exception, whose traceback holds this frame:
            # without these locals that is not a cycle (which only the collector frees).
            del p_task, d_task
            p_error, done = None, set()
            raise

    def _watch_prefill(
        self, opened: Dispatch, plan: Plan, pair: Pair, task: asyncio.Task[PrefillResult]
    ) -> None:
        """P ended while D was already streaming. If P failed, end D so the client sees
        the error (the relay reports P's error, not D's cut stream). Nothing to do once
        the dispatch has closed D."""
        if task.cancelled() or opened.leg.closed:
            return
        exc = task.exception()
        if isinstance(exc, UpstreamError):
            opened.prefill_error = exc
            opened.leg.stream.close()
        elif exc is None:
            plan.prefill_done(pair, task.result())

    # -- legs ------------------------------------------------------------------

    async def _prefill(
        self,
        pool: ModelPool,
        plan: Plan,
        pair: Pair,
        params: dict[str, Any],
        prompt_ids: bool = False,
    ) -> PrefillResult:
        """P's leg; with ``prompt_ids``, P is asked for the prompt's token ids (P's answer
        never reaches the client)."""
        started = self._clock()
        body = kp.prefill_body(pair.creq.body, params, pair.creq.endpoint, pair.ids.request_id)
        if prompt_ids:
            body["return_token_ids"] = True
        p = pair.prefill
        first = _computes_nothing(p)
        tokens = pair.creq.estimated_prompt_tokens()
        pool.timings.prefill_tokens.add(started, tokens)  # P's demand (router/demand.py)
        try:
            with self._tracing.span("prefill", {"pdrouter.engine": p.key}):
                result = await self._legs.prefill(
                    pool.name,
                    p,
                    pair.creq.endpoint,
                    body,
                    pair.ids.request_id,
                    require_params=plan.requires_params,
                    traceparent=self._tracing.traceparent(),
                )
        except UpstreamError as exc:
            pool.record(p, exc.fault)
            raise
        else:
            pool.record(p, None)
            if first:
                pool.timings.observe_prefill(self._clock() - started, tokens)
            return result
        finally:
            self._metrics.prefill_duration.labels(pool.name, pool.mode).observe(
                self._clock() - started
            )

    async def _decode(
        self,
        pool: ModelPool,
        d: Instance,
        creq: ClientRequest,
        body: dict[str, Any],
        ids: kp.DispatchIds,
        alone: bool = False,
    ) -> DecodeLeg:
        """Open D's leg (``alone``: ``d`` computes the prompt, no P; ``d`` is then D, or P
        serving the request alone). A leg is judged when it ends (the dispatch's exit),
        except a half-open D's trial, which succeeds with its first bytes: the other
        requests need not wait for the whole stream to know that D is back. A streamed
        leg ``alone`` teaches the model's prefill time (its first bytes), if it found ``d``
        computing no other prompt."""
        started = self._clock()
        first = alone and _computes_nothing(d)
        try:
            with self._tracing.span("decode_first_byte", {"pdrouter.engine": d.key}):
                leg = await self._legs.open_decode(
                    d,
                    creq.endpoint,
                    body,
                    ids.request_id,
                    creq.stream,
                    self._tracing.traceparent(),
                    computes_prompt=alone,
                )
        except UpstreamError as exc:
            pool.record(d, exc.fault)
            raise
        if d.breaker.state is BreakerState.HALF_OPEN:
            pool.record(d, None)
        if first and creq.stream:
            pool.timings.observe_prefill(self._clock() - started, creq.estimated_prompt_tokens())
        return leg

    def _observe_handoff(self, pool: ModelPool, prefill_done_at: float) -> None:
        handoff = max(0.0, self._clock() - prefill_done_at)
        self._metrics.handoff.labels(pool.name, pool.mode).observe(handoff)
        self._tracing.set(pdrouter__handoff_s=handoff)

    async def _finish(self, pool: ModelPool, opened: Dispatch) -> None:
        """Release everything the dispatch holds and judge D by its verdict. A P leg
        still running is drained when D's stream completed, cancelled otherwise."""
        verdict = opened.verdict
        try:
            await opened.leg.close()
        finally:
            if opened.reservation is not None:
                pool.ledger.release(opened.reservation)
        pool.record(opened.leg.instance, verdict)
        _observe_stream(pool, opened.leg)
        task = opened.prefill_task
        if task is None:
            return
        if not task.done():
            if verdict is None:
                await asyncio.gather(task, return_exceptions=True)
            else:
                await cancel_task(task)
        if not task.cancelled() and task.exception():
            log.warning(
                "event=late_prefill_failure request_id=%s reason=%r",
                opened.request_id,
                str(task.exception()),
            )


# What each single-engine choice of the adaptive rule runs as (pd: the decision as it was).
_ADAPTED = {
    adaptive.Choice.DECODE_ALONE: Decision.DECODE_ALONE,
    adaptive.Choice.PREFILL_ALONE: Decision.PREFILL_ALONE,
}


def _computes_nothing(inst: Instance) -> bool:
    """Whether ``inst`` computes no prompt for this router: a prompt sent now is computed
    at once, so its time is the computation's, without a wait behind others. The adaptive
    rule multiplies that by the prompts queued (router/pd/adaptive.py); a time that held
    the queue's wait would count the queue twice, and under load would grow past any
    budget (a 768-token prompt then "cost" 3 s on a P that computes it in 1.2)."""
    return inst.legs_running == 0 and inst.prefilling == 0


def _observe_stream(pool: ModelPool, leg: DecodeLeg) -> None:
    """A stream read cleanly to its end teaches its role's step time."""
    if leg.verdict is None and leg.ended_at is not None and leg.chunks > 1:
        on_prefill = leg.instance.role is Role.PREFILL
        pool.timings.observe_stream(leg.ended_at - leg.first_at, leg.chunks - 1, on_prefill)


class _Dispatching:
    """:meth:`Dispatcher.dispatch`: a class, not an ``asynccontextmanager``, whose async
    generator costs every request about ten calls more."""

    __slots__ = ("_alone", "_avoid", "_client_id", "_creq", "_dispatcher", "_opened", "_pool")

    def __init__(
        self,
        dispatcher: Dispatcher,
        pool: ModelPool,
        creq: ClientRequest,
        client_id: str,
        avoid: frozenset[Instance],
        prefill_alone: bool = False,
    ) -> None:
        self._dispatcher, self._pool, self._creq = dispatcher, pool, creq
        self._client_id, self._avoid, self._alone = client_id, avoid, prefill_alone
        self._opened: Dispatch | None = None

    async def __aenter__(self) -> Dispatch:
        d, pool = self._dispatcher, self._pool
        opened = await d._open(pool, self._creq, self._client_id, self._avoid, self._alone)
        self._opened = opened
        return opened

    async def __aexit__(self, *exc: object) -> None:
        opened, self._opened = self._opened, None
        assert opened is not None
        await self._dispatcher._finish(self._pool, opened)


def _ok(allowed: Callable[[Instance], bool] | None, inst: Instance) -> bool:
    return allowed is None or allowed(inst)


def _both(
    first: Callable[[Instance], bool] | None, second: Callable[[Instance], bool]
) -> Callable[[Instance], bool]:
    return lambda inst: _ok(first, inst) and second(inst)


def _only(name: str, allowed: Callable[[Instance], bool] | None) -> Callable[[Instance], bool]:
    """``allowed`` narrowed to the engine an endpoint picker chose: ``name`` is its key (one
    data-parallel rank, ``<url>#dp<r>``), or its URL (every rank behind it, as a picker
    that names URLs only said)."""
    return lambda inst: name in (inst.key, inst.url) and _ok(allowed, inst)


def _rank_only(rank: int, allowed: Callable[[Instance], bool] | None) -> Callable[[Instance], bool]:
    """``allowed`` narrowed to data-parallel rank ``rank`` (the rank an endpoint picker
    reserved its slot on; an engine without data parallelism has no rank to narrow)."""
    return lambda inst: (inst.rank is None or inst.rank == rank) and _ok(allowed, inst)


def _log_failed_attempt(exc: UpstreamError, client_id: str, attempt: int, retry: bool) -> None:
    log.warning(
        "event=attempt_failed request_id=%s client_id=%s attempt=%d role=%s "
        "engine=%s reason=%r cause=%r retry=%s",
        exc.request_id,
        client_id,
        attempt,
        exc.role,
        exc.instance,
        exc.message,
        str(exc.__cause__ or exc.code),
        "yes" if retry else "no",
    )


async def _client_left(
    pool: ModelPool,
    plan: Plan,
    pair: Pair,
    res: Reservation,
    p_task: asyncio.Task[PrefillResult],
    d_task: asyncio.Task[DecodeLeg],
) -> None:
    """The client left during a concurrent attempt: the plan takes both legs over if it
    must (the slot then released by it once they are settled), else both are closed."""
    both_running = not p_task.done() and not d_task.done()
    if both_running and plan.abandon(pair, p_task, d_task, lambda: pool.ledger.release(res)):
        res.detached = True  # released by the plan once the legs are settled
        return
    await discard_decode(d_task)
    await cancel_task(p_task)


def _failed(pool: ModelPool, exc: UpstreamError) -> set[Instance]:
    """The engines a retry avoids after ``exc``: the one that failed; where nothing listened
    at its URL, every data-parallel rank behind that URL too (one API server serves them all)."""
    url = split_engine_key(exc.instance)[0] if exc.fault is Fault.REFUSED else None
    return {i for i in _all(pool) if i.key == exc.instance or i.url == url}


def _all(pool: ModelPool) -> list[Instance]:
    return [*pool.prefill, *pool.decode]


def _deadline(pool: ModelPool, creq: ClientRequest) -> Deadline | None:
    """The request's deadline for the ledger, with its predicted time to first token once
    it holds a slot: the prompt's learned compute time (0 until one is learned)."""
    if creq.deadline_at is None or creq.ttft_deadline_ms is None:
        return None
    per_token = pool.timings.prefill_s_per_token
    service = 0.0 if per_token is None else per_token * creq.estimated_prompt_tokens()
    return Deadline(creq.deadline_at, creq.ttft_deadline_ms, service)
