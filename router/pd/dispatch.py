"""Dispatch one client request up to D's first bytes: slot first, then the plan's legs.

Per attempt: reserve a decode slot (may queue; before any upstream call), select P,
run the decision's plan (``router/pd/plans.py``) sequentially or concurrently, and
open D's stream. A model with ``adaptive`` on may serve a request by D alone or P alone
instead (``router/pd/adaptive.py``); P alone holds no decode slot. An attempt that fails
before the client has seen a byte is retried with fresh ids on a re-selected pair,
avoiding the failed instance.

:class:`Dispatcher` is the facade over the three parts: choosing the engines
(``router/pd/selection.py``), the attempts (``router/pd/retry.py``) and running an
attempt's plan (``router/pd/run_plan.py``). :meth:`Dispatcher.dispatch` is an
``async with``: it is entered once D's first bytes are in, and its exit releases
everything the request holds (the slot, D's stream, a P leg still running) and judges D
by the leg's verdict, on every exit path.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from router.client_request import ClientRequest
from router.config import RetryConfig
from router.engines.adapter_loads import AdapterLoader
from router.engines.instance import Instance
from router.kvindex.route import CacheScorer
from router.lifecycle import Lifecycle
from router.pd.attempt_legs import AttemptLegs
from router.pd.kept_turns import KeptTurns
from router.pd.legs import LegRunner
from router.pd.opened import Dispatch
from router.pd.plans import plans
from router.pd.retry import Retrier
from router.pd.run_plan import PlanRunner
from router.pd.selection import Pick, Selector
from router.pd.settle import Settler, cancel_task
from router.registry import ModelPool

__all__ = ["Dispatcher", "Pick"]

log = logging.getLogger("pd_router.dispatch")


class Dispatcher:
    def __init__(
        self,
        legs: LegRunner,
        turns: KeptTurns,
        lifecycle: Lifecycle,
        retries: RetryConfig,
        clock: Callable[[], float] = time.monotonic,
        probe_interval: float = 5.0,
        traceparent: Callable[[], str | None] = lambda: None,
        scorer: CacheScorer | None = None,
        adapters: AdapterLoader | None = None,
    ) -> None:
        """``lifecycle``: what the dispatch announces to (router/lifecycle.py).
        ``probe_interval``: the health-check interval (Retry-After of a refusal).
        ``traceparent``: the W3C header naming the current span, for the engine calls.
        ``scorer``: cache-aware routing for models with ``kv_events`` on. ``adapters``:
        loads a model's ``lora.modules`` on the chosen engines that lack them."""
        self.lifecycle = lifecycle
        self.settler = Settler(legs.timeouts)
        self._select = Selector(lifecycle, clock, probe_interval, scorer)
        self._retry = Retrier(retries, lifecycle)
        by_decision = plans(self.settler, lifecycle.push_fallback)
        attempt_legs = AttemptLegs(legs, lifecycle, traceparent, clock, adapters)
        self._attempt_legs = attempt_legs
        self._run = PlanRunner(self._select, attempt_legs, by_decision, turns, lifecycle)

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
        decision, route = await self._select.route(pool, creq, prefill_alone)
        attempt = functools.partial(self._run.attempt, pool, creq, decision, route)
        return await self._retry.run(pool, attempt, client_id, avoid)

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
        return await self._select.pick(pool, creq, reachable)

    def unpick(self, pool: ModelPool, pick: Pick) -> None:
        """Give back what :meth:`pick` holds (idempotent): the decode slot."""
        if pick.reservation is not None:
            pool.ledger.release(pick.reservation)

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
        self._attempt_legs.stream_ended(pool, opened.leg)
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
