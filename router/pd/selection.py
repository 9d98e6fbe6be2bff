"""Choosing a request's engines: its decision, what selection goes by, D's slot and P.

:class:`Selector` decides how a request is served (the mode's rule, the adaptive rule, or
an endpoint picker's choice), builds its :class:`~router.pd.routing.Route` (routing key,
session, cache-aware route, the engines a LoRA adapter allows), waits for a decode slot
(the ledger's queue) and selects the P that pairs with a D. It calls no engine except the
cache-aware route's ``/tokenize``; a refusal is raised before any slot is held.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from router.client_request import ClientRequest
from router.engines.adapters import requested_adapter
from router.engines.affinity import Placement
from router.engines.instance import Instance, Role, candidates, refusal
from router.engines.ledger import Deadline, Reservation
from router.errors import DeadlineExceeded, NoCapacity, NoHealthyEngine, QueueFull, RouteChoice
from router.kvindex.route import CacheRoute, CacheScorer, Result
from router.lifecycle import Lifecycle
from router.pd import adaptive
from router.pd.decision import Decision, decide
from router.pd.routing import Route, prefill_busy, routing_key
from router.registry import ModelPool

__all__ = ["SLOT_WAIT", "Pick", "Selector"]

SLOT_WAIT = "slot_wait"  # the phase of waiting for a decode slot


@dataclass(frozen=True, slots=True)
class Pick:
    """What :meth:`Selector.pick` chose: the decision, the decode slot held (None: P
    alone), its D and the P to pair with it (None where the decision uses none)."""

    decision: Decision
    reservation: Reservation | None
    decode: Instance | None
    prefill: Instance | None


class Selector:
    def __init__(
        self,
        lifecycle: Lifecycle,
        clock: Callable[[], float] = time.monotonic,
        probe_interval: float = 5.0,
        scorer: CacheScorer | None = None,
    ) -> None:
        """``probe_interval``: the health-check interval (Retry-After of a refusal).
        ``scorer``: cache-aware routing for models with ``kv_events`` on."""
        self._events = lifecycle
        self._clock = clock
        self._probe_interval = probe_interval
        self._scorer = scorer

    async def route(
        self, pool: ModelPool, creq: ClientRequest, prefill_alone: bool = False
    ) -> tuple[Decision, Route]:
        """The request's decision (counted) and what selection goes by. A request an endpoint
        picker already placed (``creq.picked_decision``, a ``pd-router sidecar``'s) keeps the
        picker's decision, and its P is the one the picker named. ``prefill_alone``: a
        migration's continuation with no other D to go to, which P serves alone."""
        decision = self._decide(pool, creq, prefill_alone)
        self._events.decided(pool.name, decision)
        # The key is built at most once, and only if the policy or the session fallback needs it.
        key = routing_key(creq) if pool.routing_key_needed else None
        session = pool.session_key(creq.session, lambda: key or routing_key(creq))
        # A LoRA adapter's request: only engines that hold it (router/engines/adapters.py).
        adapter = requested_adapter(pool.name, creq.body)
        prefill_ok = pool.adapter_filter(adapter, Role.PREFILL, paired=True)
        if creq.picked_prefill is not None:
            prefill_ok = _only(creq.picked_prefill, prefill_ok)
        decode_ok = pool.adapter_filter(adapter, Role.DECODE, paired=decision.uses_prefill)
        if creq.picked_rank is not None:
            decode_ok = _rank_only(creq.picked_rank, decode_ok)
        cache = await self._cache_route(pool, creq)
        return decision, Route(key, session, cache, prefill_ok, decode_ok)

    def _decide(self, pool: ModelPool, creq: ClientRequest, prefill_alone: bool) -> Decision:
        if prefill_alone:
            return Decision.PREFILL_ALONE
        if creq.picked_decision is not None:
            return Decision(creq.picked_decision)
        decision = decide(pool.mode, creq, pool.config.disagg_min_prompt_tokens, prefill_busy(pool))
        return self._adapt(pool, creq, decision)

    def _adapt(self, pool: ModelPool, creq: ClientRequest, decision: Decision) -> Decision:
        """The adaptive rule's decision for a request the model's mode would split (counted);
        ``decision`` as it is otherwise, or when the model has the rule off."""
        cfg = pool.config.adaptive
        if not cfg.enabled or decision.value != pool.mode.value:
            return decision
        choice = adaptive.decide(cfg, pool, creq.estimated_prompt_tokens(), self._clock())
        self._events.adapted(pool.name, choice)
        return _ADAPTED.get(choice, decision)

    async def _cache_route(self, pool: ModelPool, creq: ClientRequest) -> CacheRoute | None:
        """The request's cache-aware route (router/kvindex/route.py), if its model has one."""
        if self._scorer is None or not pool.config.kv_events.enabled:
            return None
        started = self._clock()
        route = await self._scorer.route(pool, creq)
        self._events.cache_scored(pool.name, self._clock() - started)
        return route

    async def pick(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        reachable: Callable[[Instance], bool] | None = None,
    ) -> Pick:
        """See :meth:`router.pd.dispatch.Dispatcher.pick`."""
        decision, route = await self.route(pool, creq)
        if reachable is not None:
            decode_ok = _both(route.decode_ok, reachable)
            if decision is Decision.PREFILL_ALONE:
                route = replace(route, prefill_ok=_both(route.prefill_ok, reachable))
            route = replace(route, decode_ok=decode_ok)
        self.check_prefill(pool, decision, route)
        if decision is Decision.PREFILL_ALONE:
            # (the cache-aware choice of a P alone is not counted here, as it never was)
            p = self.prefill(pool, route, frozenset(), counted=False)
            return Pick(decision, None, None, p)
        reservation = await self.reserve(pool, creq, route, frozenset())
        if not decision.uses_prefill:
            return Pick(decision, reservation, reservation.instance, None)
        try:
            p = self.prefill(pool, route, frozenset(), reservation.instance)
        except NoHealthyEngine:
            pool.ledger.release(reservation)
            raise
        return Pick(decision, reservation, reservation.instance, p)

    def check_prefill(self, pool: ModelPool, decision: Decision, route: Route) -> None:
        """Refuse a decision that needs a P when none the route allows is in rotation:
        refused before a decode slot is taken, where no queue wait can end well. (An
        adapter whose holders are all out: no P for it, whatever the other Ps.)"""
        if not decision.uses_prefill:
            return
        allowed = route.prefill_ok
        if not [p for p in candidates(pool.prefill) if allowed is None or allowed(p)]:
            raise self.no_prefill(pool)

    def prefill(
        self,
        pool: ModelPool,
        route: Route,
        avoid: frozenset[Instance],
        decode: Instance | None = None,
        counted: bool = True,
    ) -> Instance:
        """The P for the request (paired with ``decode`` where given), or the
        :class:`~router.errors.NoHealthyEngine` refusal; its placement announced, and how
        cache-aware routing chose it unless not ``counted``."""
        lease = pool.select_prefill(route.selection(avoid), decode=decode, allowed=route.prefill_ok)
        if lease is None:  # or left rotation while this request waited for its slot
            raise self.no_prefill(pool, decode)
        self._count_placement(pool, Role.PREFILL, lease.placement)
        if counted:
            self._count_choice(pool, Role.PREFILL, route.cache)
        return lease.instance

    async def reserve(
        self, pool: ModelPool, creq: ClientRequest, route: Route, avoid: frozenset[Instance]
    ) -> Reservation:
        """A decode slot (may queue: the wait is the key's queue-wait metric)."""
        waited_from = self._clock()
        with self._events.phase(SLOT_WAIT):
            try:
                reservation = await pool.ledger.reserve(
                    route.selection(avoid, creq.api_key_name),
                    level=creq.priority_level,
                    deadline=_deadline(pool, creq),
                    allowed=route.decode_ok,
                )
            except (NoCapacity, QueueFull) as exc:
                self._count_refusal(pool, creq, exc)
                raise
        waited = self._clock() - waited_from
        cls = creq.priority_class or "-"
        self._events.slot_waited(pool.name, creq.api_key_name, cls, waited)
        self._count_placement(pool, Role.DECODE, reservation.placement)
        self._count_choice(pool, Role.DECODE, route.cache)
        return reservation

    def no_prefill(self, pool: ModelPool, d: Instance | None = None) -> NoHealthyEngine:
        """No P in rotation; or, given D, none of those in rotation pairs with it (its
        partners are out: the engines of other versions serve other Ds)."""
        if d is not None and candidates(pool.prefill):
            why = f"none in rotation pairs with decode engine {d.key} ({d.facts.describe()})"
            return NoHealthyEngine(Role.PREFILL.value, pool.name, self._probe_interval, why)
        return refusal(Role.PREFILL, pool.name, pool.prefill, self._clock(), self._probe_interval)

    def _count_refusal(
        self, pool: ModelPool, creq: ClientRequest, exc: NoCapacity | QueueFull
    ) -> None:
        missed = isinstance(exc, DeadlineExceeded)
        self._events.refused(pool.name, creq.priority_class or "-", exc.code, missed)

    def _count_placement(self, pool: ModelPool, role: Role, placement: Placement | None) -> None:
        if placement is not None:
            self._events.routed(pool.name, role, placement)

    def _count_choice(self, pool: ModelPool, role: Role, cache: CacheRoute | None) -> None:
        """Count how cache-aware routing chose ``role``'s engine, and what it predicted."""
        if cache is None:
            if pool.config.kv_events.enabled:
                self._events.cache_routed(pool.name, role, Result.NO_TOKENS)
            return
        result = cache.results.get(role)
        if result is None:
            return
        self._events.cache_routed(pool.name, role, result)
        predicted = cache.predicted.get(role)
        if predicted is not None and result is not Result.UNKNOWN:
            self._events.cache_predicted(pool.name, role, predicted, len(cache.tokens))


# What each single-engine choice of the adaptive rule runs as (pd: the decision as it was).
_ADAPTED = {
    RouteChoice.DECODE_ALONE: Decision.DECODE_ALONE,
    RouteChoice.PREFILL_ALONE: Decision.PREFILL_ALONE,
}


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


def _deadline(pool: ModelPool, creq: ClientRequest) -> Deadline | None:
    """The request's deadline for the ledger, with its predicted time to first token once
    it holds a slot: the prompt's learned compute time (0 until one is learned)."""
    if creq.deadline_at is None or creq.ttft_deadline_ms is None:
        return None
    per_token = pool.timings.prefill_s_per_token
    service = 0.0 if per_token is None else per_token * creq.estimated_prompt_tokens()
    return Deadline(creq.deadline_at, creq.ttft_deadline_ms, service)
