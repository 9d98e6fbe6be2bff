"""The adaptive choice, per request, between P/D, D alone and P alone on a disaggregated pair.

Both engines of a pair are complete vLLM engines: P can serve a whole request, D can compute
its own prompt. One engine is faster when both are idle (no transfer, no second hop), P/D
when a prompt computed on D would stall the streams D decodes. The rule (``docs/policy.md``),
with ``n`` the request's estimated prompt tokens and the model's recent timings
(``router/engines/timings.py``)::

    cost    = n x prefill_s_per_token              this prompt, computed on one engine
    fits(e) = (pending(e) + 1) x cost <= ttft      its TTFT there, behind e's own prompts,
              and (streams(e) = 0 and busy(e) = 0  and the streams there, its own too, keep
                   or step / (1 - busy(e))         their TPOT: slowed by e's share of time
                      + (streams(e) > 0 and        on prompts, and stalled by this one
                         (pending(e) + 1) x cost / stall_tokens) <= tpot)

    no timings yet                   -> pd    (the static mode, which teaches them)
    P has a prompt pending           -> decode_alone if D fits and has fewer prompts
                                              pending than P, else pd (the shorter queue,
                                              within what D's streams' TPOT affords)
    neither P nor D fits             -> pd
    else the less loaded that fits   -> prefill_alone or decode_alone
                                             (load = streams + pending; a tie goes to D)

``streams(e)``: requests decoding on engine ``e`` (D: the slots held there but its pending
prompts; P: its P-alone streams, first bytes in and end not seen);
``pending(e)``: prompts ``e`` still computes for this router (P: its legs, and its P-alone
requests before their first bytes; D: its D-alone requests before theirs); ``busy(e)``: the
share of recent requests that found ``e`` with a prompt pending (``Timings``), i.e. of its
time on prompts: on P that is every P/D request's prefill, which a stream served by P alone
would wait behind for as long as it decodes. P and D are the
least loaded routable engine of each role (D: with a free slot; of equals, the one with the
fewest prompts pending). With several router replicas (``admission.replicas > 1``), the
engines' own gauges (``vllm:num_requests_running`` + ``waiting``, read every
``health.load_interval`` by ``router/engines/reported.py``) add the other replicas' requests:
to P's pending prompts, and to D's streams. ``single_engine`` limits which may serve alone.

:func:`choose` is the rule, a pure function of :class:`Inputs`; :func:`inputs` reads them
from the model's pool.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from router.config import AdaptiveConfig
from router.engines.instance import Instance, candidates
from router.registry import ModelPool

__all__ = ["Choice", "EngineLoad", "Inputs", "choose", "decide", "inputs"]

# An engine busy with prompts all the time still decodes between them: the stretch of its
# streams' steps is capped at 20x (beyond any TPOT target a step could meet).
_MIN_FREE = 0.05


class Choice(enum.StrEnum):
    """How the adaptive rule serves a request (the ``choice`` label of its counter)."""

    PD = "pd"
    DECODE_ALONE = "decode_alone"
    PREFILL_ALONE = "prefill_alone"


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine as the rule sees it."""

    streams: int  # requests decoding there
    pending: int  # prompts it still computes for this router

    @property
    def total(self) -> int:
        return self.streams + self.pending


@dataclass(frozen=True, slots=True)
class Inputs:
    """What the rule reads: the prompt, the recent timings (None: none observed yet) and the
    least loaded routable engine of each role (None: no routable one)."""

    prompt_tokens: int
    prefill_s_per_token: float | None
    step_s: float | None
    prefill: EngineLoad | None
    decode: EngineLoad | None
    prefill_busy: float = 0.0  # share of time P spends on prompts (recent requests saw)
    decode_busy: float = 0.0  # and D


def choose(cfg: AdaptiveConfig, x: Inputs) -> Choice:
    """The rule of the module doc, for one request."""
    if x.prefill_s_per_token is None or x.step_s is None or x.prefill is None:
        return Choice.PD
    cost = x.prompt_tokens * x.prefill_s_per_token
    step = x.step_s

    def fits(e: EngineLoad | None, busy: float) -> bool:
        if e is None:
            return False
        stall = (e.pending + 1) * cost
        if stall * 1000 > cfg.ttft_ms:
            return False
        if e.streams == 0 and busy == 0:
            return True  # nothing decodes there, and no prompt of its own will stall this one
        tpot = step / max(1.0 - busy, _MIN_FREE) + (stall / cfg.stall_tokens if e.streams else 0)
        return tpot * 1000 <= cfg.tpot_ms

    d_ok = cfg.single_engine != "prefill" and fits(x.decode, x.decode_busy)
    if x.prefill.pending > 0:
        # Not low load: the shorter queue of prompts serves, D only while its streams keep
        # their TPOT (d_ok), so D computes prompts up to the share its streams can afford.
        behind_d = x.decode.pending if x.decode is not None else 0
        return Choice.DECODE_ALONE if d_ok and behind_d < x.prefill.pending else Choice.PD
    p_ok = cfg.single_engine != "decode" and fits(x.prefill, x.prefill_busy)
    if p_ok and (not d_ok or (x.decode is not None and x.prefill.total < x.decode.total)):
        return Choice.PREFILL_ALONE
    if d_ok:
        return Choice.DECODE_ALONE
    return Choice.PD


def decide(cfg: AdaptiveConfig, pool: ModelPool, prompt_tokens: int) -> Choice:
    """The rule's choice for a request of ``prompt_tokens`` (estimated) arriving at ``pool``;
    what the arrival found is recorded in the pool's timings (the busy shares)."""
    x = inputs(pool, prompt_tokens)
    p_busy = x.prefill is not None and x.prefill.pending > 0
    pool.timings.observe_arrival(p_busy, x.decode is not None and x.decode.pending > 0)
    return choose(cfg, x)


def _least(loads: list[EngineLoad]) -> EngineLoad | None:
    """The least loaded; of equals, the one with the fewest prompts pending."""
    return min(loads, key=lambda e: (e.total, e.pending), default=None)


def _prefill_load(p: Instance, others: int) -> EngineLoad:
    # Other replicas' requests on P are mostly prompts: counted as pending.
    return EngineLoad(streams=p.at_engine, pending=p.legs_running + p.prefilling + others)


def _decode_load(d: Instance, others: int) -> EngineLoad:
    # Every slot held is a request on D: decoding, or waiting for its KV, or a prompt of
    # its own (pending); other replicas' requests on D count as streams.
    return EngineLoad(streams=max(0, d.in_use - d.prefilling) + others, pending=d.prefilling)


def inputs(pool: ModelPool, prompt_tokens: int) -> Inputs:
    """The rule's inputs for a request of ``prompt_tokens`` (estimated) to ``pool``."""
    timings = pool.timings

    def others(inst: Instance) -> int:
        return max(0, pool.load(inst) - inst.load)

    return Inputs(
        prompt_tokens,
        timings.prefill_s_per_token,
        timings.step_s,
        _least([_prefill_load(p, others(p)) for p in candidates(pool.prefill)]),
        _least([_decode_load(d, others(d)) for d in candidates(pool.decode) if d.free_slots > 0]),
        timings.prefill_busy,
        timings.decode_busy,
    )
