"""Running one attempt's plan: the legs per decision, their order, the handoff, kept turns.

:class:`PlanRunner` serves an attempt whose decision and route are known: P alone (no decode
slot), D alone, or a disaggregated pair whose plan (``router/pd/plans.py``) runs the legs
sequentially (P to completion, then D with P's parameters) or concurrently (both at once;
D's first bytes first). Whatever fails, no leg is left running and the slot is released,
unless the plan took both legs over (the client left: :meth:`Plan.abandon`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from router.client_request import ClientRequest
from router.engines.instance import Instance
from router.engines.ledger import Reservation
from router.errors import UpstreamError, UpstreamStatus
from router.lifecycle import Lifecycle
from router.pd import kv_params as kp
from router.pd.attempt_legs import AttemptLegs
from router.pd.decision import Decision
from router.pd.decode_leg import DecodeLeg, PrefillResult
from router.pd.kept_turns import KeptTurns, TurnPlan
from router.pd.opened import Dispatch
from router.pd.plans import Pair, Plan
from router.pd.routing import Route
from router.pd.selection import Selector
from router.pd.settle import cancel_task, discard_decode
from router.registry import ModelPool

__all__ = ["PlanRunner"]

log = logging.getLogger("pd_router.dispatch")


class PlanRunner:
    def __init__(
        self,
        select: Selector,
        legs: AttemptLegs,
        plans: dict[Decision, Plan],
        turns: KeptTurns,
        lifecycle: Lifecycle,
    ) -> None:
        self._select, self._legs, self._plans = select, legs, plans
        self._turns, self._events = turns, lifecycle

    async def attempt(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        decision: Decision,
        route: Route,
        avoid: frozenset[Instance],
    ) -> Dispatch:
        """One attempt, D's first bytes in; raises its failure with nothing held."""
        self._select.check_prefill(pool, decision, route)
        if decision is Decision.PREFILL_ALONE:
            return await self._prefill_alone(pool, creq, route, avoid)
        reservation = await self._select.reserve(pool, creq, route, avoid)
        ids = kp.new_dispatch_ids()
        if self._events.annotates:
            self._events.annotate(
                {
                    "pdrouter.decode": reservation.instance.key,
                    "pdrouter.request_id": ids.request_id,
                    "pdrouter.transfer_id": ids.transfer_id,
                }
            )
        try:
            if decision.uses_prefill:
                return await self._split(pool, creq, decision, route, avoid, reservation, ids)
            await self._legs.load_adapter(pool, creq, reservation.instance)
            body = kp.aggregated_body(creq.body)
            leg = await self._legs.decode(pool, reservation.instance, creq, body, ids, alone=True)
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
        p = self._select.prefill(pool, route, avoid)
        ids = kp.new_dispatch_ids()
        if self._events.annotates:
            self._events.annotate(
                {"pdrouter.prefill": p.key, "pdrouter.request_id": ids.request_id}
            )
        try:
            await self._legs.load_adapter(pool, creq, p)
            body = kp.aggregated_body(creq.body)
            leg = await self._legs.decode(pool, p, creq, body, ids, alone=True)
        except UpstreamError as exc:
            exc.request_id = ids.request_id  # for the attempt's log line
            raise
        return Dispatch(None, leg, Decision.PREFILL_ALONE, ids.request_id, prefill_engine=p.key)

    async def _split(
        self,
        pool: ModelPool,
        creq: ClientRequest,
        decision: Decision,
        route: Route,
        avoid: frozenset[Instance],
        res: Reservation,
        ids: kp.DispatchIds,
    ) -> Dispatch:
        """A disaggregated attempt, its decode slot held: select a P that can pair with its
        D, run the plan."""
        d = res.instance
        p = self._select.prefill(pool, route, avoid, d)
        await self._legs.load_adapter(pool, creq, p, d)
        pair = Pair(creq, ids, p, d)
        if self._events.annotates:
            self._events.annotate({"pdrouter.prefill": p.key})
        plan = self._plans[decision]
        turn = self._turns.plan(pool, creq, route.cache, d)
        if plan.concurrent(pair):
            return await self._concurrent(pool, plan, pair, decision, res, turn)
        return await self._sequential(pool, plan, pair, decision, res, turn)

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
        leg = await self._legs.decode(pool, pair.decode, pair.creq, body, pair.ids)
        self._turns.keep(pool, pair.creq, turn, leg, result.prompt_ids)
        self._legs.handed_off(pool, result.finished_at)
        return Dispatch(
            res,
            leg,
            decision,
            pair.ids.request_id,
            prefill_engine=pair.prefill.key,
            prefill_result=result,
        )

    async def _prefill_turn(
        self, pool: ModelPool, plan: Plan, pair: Pair, turn: TurnPlan | None
    ) -> PrefillResult:
        """P's leg, reading the kept turn from D where it matches. If P fails with it (D
        freed it early, the read failed), P is asked once more without it."""
        params = plan.prefill_params(pair)
        if turn is None:
            return await self._legs.prefill(pool, plan, pair, params)
        await self._turns.prepare(pool, pair.creq, pair.prefill, turn)
        ids = turn.streamed  # a streamed turn is kept with the prompt's ids, from P
        if turn.reuse is None:
            return await self._legs.prefill(pool, plan, pair, params, ids)
        try:
            return await self._legs.prefill(pool, plan, pair, {**params, **turn.reuse}, ids)
        except UpstreamStatus as exc:
            log.warning(
                "event=kept_turn_failed request_id=%s engine=%s status=%d",
                pair.ids.request_id,
                pair.prefill.key,
                exc.status,
            )
            return await self._legs.prefill(pool, plan, pair, params, ids)

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
            prefill_engine=pair.prefill.key,
            on_clean_end=on_clean_end,
        )
        if not p_task.done():
            p_task.add_done_callback(lambda t: _watch_prefill(opened, plan, pair, t))
        elif p_task.exception() is None:
            plan.prefill_done(pair, p_task.result())
            self._legs.handed_off(pool, p_task.result().finished_at)
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
        p_task = asyncio.create_task(self._legs.prefill(pool, plan, pair, p_params))
        d_task = asyncio.create_task(
            self._legs.decode(pool, pair.decode, pair.creq, d_body, pair.ids)
        )
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
    opened: Dispatch, plan: Plan, pair: Pair, task: asyncio.Task[PrefillResult]
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
