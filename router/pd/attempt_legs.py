"""One attempt's engine calls: P's leg and the opening of D's stream, judged and timed, and
the request's LoRA adapter loaded on the chosen engines first.

:class:`AttemptLegs` wraps :class:`~router.pd.legs.LegRunner`'s calls with what every
attempt does around them: the engine judged by the leg's outcome (``pool.record``), the
legs' times announced (the model's routing timings learn from them in router/observers/
timings.py: a prompt's time only where it is the computation's alone), and each leg's span.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from router.client_request import ClientRequest
from router.engines.adapter_loads import AdapterLoader
from router.engines.adapters import requested_adapter
from router.engines.breaker import BreakerState
from router.engines.instance import Instance
from router.errors import UpstreamError
from router.lifecycle import Lifecycle
from router.pd import kv_params as kp
from router.pd.decode_leg import DecodeLeg, PrefillResult
from router.pd.legs import LegRunner
from router.pd.plans import Pair, Plan
from router.registry import ModelPool

__all__ = ["DECODE_FIRST_BYTE", "PREFILL", "AttemptLegs"]

PREFILL = "prefill"  # the phase of P's leg
DECODE_FIRST_BYTE = "decode_first_byte"  # the phase of D's leg up to its first bytes


class AttemptLegs:
    def __init__(
        self,
        legs: LegRunner,
        lifecycle: Lifecycle,
        traceparent: Callable[[], str | None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        adapters: AdapterLoader | None = None,
    ) -> None:
        """``traceparent``: the W3C header naming the current span, for the engine calls
        (None: tracing off). ``adapters``: loads a model's ``lora.modules`` on the chosen
        engines that lack them."""
        self._legs = legs
        self._adapters = adapters
        self._events = lifecycle
        self._traceparent = traceparent
        self._clock = clock

    async def prefill(
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
        first = computes_nothing(p)
        tokens = pair.creq.estimated_prompt_tokens()
        self._events.prompt_sent(pool.name, started, tokens)
        try:
            with self._events.phase(PREFILL, {"pdrouter.engine": p.key}):
                result = await self._legs.prefill(
                    pool.name,
                    p,
                    pair.creq.endpoint,
                    body,
                    pair.ids.request_id,
                    require_params=plan.requires_params,
                    traceparent=self._traceparent(),
                )
        except UpstreamError as exc:
            pool.record(p, exc.fault)
            raise
        else:
            pool.record(p, None)
            if first:
                self._events.prompt_computed(pool.name, self._clock() - started, tokens)
            return result
        finally:
            self._events.prefill_done(pool.name, pool.mode, self._clock() - started)

    async def decode(
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
        first = alone and computes_nothing(d)
        try:
            with self._events.phase(DECODE_FIRST_BYTE, {"pdrouter.engine": d.key}):
                leg = await self._legs.open_decode(
                    d,
                    creq.endpoint,
                    body,
                    ids.request_id,
                    creq.stream,
                    self._traceparent(),
                    computes_prompt=alone,
                )
        except UpstreamError as exc:
            pool.record(d, exc.fault)
            raise
        if d.breaker.state is BreakerState.HALF_OPEN:
            pool.record(d, None)
        if first and creq.stream:
            seconds = self._clock() - started
            self._events.prompt_computed(pool.name, seconds, creq.estimated_prompt_tokens())
        return leg

    async def load_adapter(self, pool: ModelPool, creq: ClientRequest, *engines: Instance) -> None:
        """The request's LoRA adapter, where the router loads it itself (``lora.modules``),
        loaded on those of the chosen ``engines`` that lack it (router/engines/
        adapter_loads.py); raises :class:`~router.errors.AdapterLoadFailed`."""
        adapter = requested_adapter(pool.name, creq.body)
        lora = pool.config.lora
        path = lora.modules.get(adapter) if adapter is not None else None
        if adapter is None or path is None or self._adapters is None:
            return
        await self._adapters.ensure(pool.name, adapter, path, engines, lora.load_timeout)

    def handed_off(self, pool: ModelPool, prefill_done_at: float) -> None:
        """D's stream opened after P finished at ``prefill_done_at``: the handoff's time."""
        handoff = max(0.0, self._clock() - prefill_done_at)
        self._events.handed_off(pool.name, pool.mode, handoff)

    def stream_ended(self, pool: ModelPool, leg: DecodeLeg) -> None:
        """A stream read cleanly to its end: its time and steps announced (its role's step
        time is learned from them)."""
        if leg.verdict is None and leg.ended_at is not None and leg.chunks > 1:
            seconds = leg.ended_at - leg.first_at
            self._events.stream_timed(pool.name, leg.instance.role, seconds, leg.chunks - 1)


def computes_nothing(inst: Instance) -> bool:
    """Whether ``inst`` computes no prompt for this router: a prompt sent now is computed
    at once, so its time is the computation's, without a wait behind others. The adaptive
    rule multiplies that by the prompts queued (router/pd/adaptive.py); a time that held
    the queue's wait would count the queue twice, and under load would grow past any
    budget (a 768-token prompt then "cost" 3 s on a P that computes it in 1.2)."""
    return inst.legs_running == 0 and inst.prefilling == 0
