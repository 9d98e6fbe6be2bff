"""The adaptive choice, per request, between P/D, D alone and P alone on a disaggregated pair.

Both engines of a pair are complete vLLM engines: P can serve a whole request, D can compute
its own prompt. One engine is faster when both are idle (no transfer, no second hop), P/D
when a prompt computed on D would stall the streams D decodes. The rule (``docs/policy.md``),
with ``n`` the request's estimated prompt tokens and the model's recent timings
(``router/engines/timings.py``)::

    cost    = n x prefill_s_per_token              this prompt, computed on one engine
    life    = stall_tokens x tpot                  a stream's life at the SLO
    budget  = ROOM x (tpot - step(e)) x stall_tokens  prompt seconds e may compute in one
                                                   life while its streams keep their TPOT
    fits(e) = (pending(e) + 1) x cost <= ttft      its TTFT there, behind e's own prompts,
              and (streams(e) = 0 and given(e) = 0 and the prompts e was given in the last
                   or given(e) + cost <= budget)   life, this one too, within the budget

    no timings yet                   -> pd    (the static mode, which teaches them)
    P has a prompt pending:
      (pending(P) + 1) x cost <= KEEP_UP x ttft -> pd (P keeps up: D's streams stay clean)
      D fits, fewer prompts pending than P      -> decode_alone (the shorter queue)
      (pending(P) + 1) x cost > ttft, D has fewer pending and its TTFT fits
                                                -> decode_alone (P/D would lose it anyway:
                                                   D's budget yields)
      else                                      -> pd
    D fits                           -> decode_alone
    P fits                           -> prefill_alone
    else                             -> pd

D is asked first: every prompt D computes is one the rule gave it, so its budget holds for
the streams it decodes; P is also given every P/D prompt that follows, which a stream it
serves alone waits behind (in the sweep, P-alone streams chosen at the start of a burst,
when P's ledger was still empty, reached 300 ms a token). ``step(e)``: D's streams' step, or
P's P-alone streams' (D's until P has served one).

``given(e)``: the prompt seconds (their ``cost`` when chosen) the rule gave ``e``'s role in
the last ``life`` seconds, per routable engine of the role: P is given every P/D request's
prompt and every P-alone one, D its D-alone ones. It is an admission bound, counted when the
rule chooses, not when the engine is seen busy: a rule that waits to see D's streams slow
down has already given D too many prompts (the third version of the rule did, at 3 QPS).
``streams(e)``: requests decoding on engine ``e`` (D: the slots held there but its pending
prompts; P: its P-alone streams, first bytes in and end not seen);
``pending(e)``: prompts ``e`` still computes for this router (P: its legs, and its P-alone
requests before their first bytes; D: its D-alone requests before theirs). P and D are the
least loaded routable engine of each role (D: with a free slot; of equals, the one with the
fewest prompts pending). With several router replicas (``admission.replicas > 1``), the
engines' own gauges (``vllm:num_requests_running`` + ``waiting``, read every
``health.load_interval`` by ``router/engines/reported.py``) add the other replicas' requests:
to P's pending prompts, and to D's streams. ``single_engine`` limits which may serve alone.

:func:`choose` is the rule, a pure function of :class:`Inputs`; :func:`inputs` reads them
from the model's pool, :func:`decide` also records what it gave.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.config import AdaptiveConfig
from router.engines.instance import Instance, candidates
from router.errors import RouteChoice
from router.registry import ModelPool

__all__ = ["KEEP_UP", "ROOM", "EngineLoad", "Inputs", "choose", "decide", "inputs"]

# The share of an engine's TPOT slack (tpot - step, over a stream's life) the rule lets its
# prompts take: a stream's TPOT is its mean over its life, and a stream that lives through a
# window at the full budget misses the target about as often as it meets it.
ROOM = 0.75
# P/D while this request's TTFT behind P's queue is within this share of the target: the
# rest is for prompts arriving meanwhile, the transfer and D's first step.
KEEP_UP = 0.5


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
    """What the rule reads: the prompt, the recent timings (None: none observed yet), the
    least loaded routable engine of each role (None: no routable one), and the prompt seconds
    given to each role in the last stream's life, per engine."""

    prompt_tokens: int
    prefill_s_per_token: float | None
    step_s: float | None  # D's streams
    prefill: EngineLoad | None
    decode: EngineLoad | None
    prefill_given: float = 0.0
    decode_given: float = 0.0
    prefill_step_s: float | None = None  # P's P-alone streams (None: D's step stands in)


def life_s(cfg: AdaptiveConfig) -> float:
    """A stream's life at the SLO: the window over which the rule counts prompts given."""
    return cfg.stall_tokens * cfg.tpot_ms / 1000


def choose(cfg: AdaptiveConfig, x: Inputs) -> RouteChoice:
    """The rule of the module doc, for one request."""
    if x.prefill_s_per_token is None or x.step_s is None or x.prefill is None:
        return RouteChoice.PD
    cost = x.prompt_tokens * x.prefill_s_per_token
    ttft = cfg.ttft_ms / 1000

    def fits(e: EngineLoad | None, given: float, step: float) -> bool:
        if e is None or (e.pending + 1) * cost > ttft:
            return False
        # Nothing decodes there and nothing was given lately: no stream's TPOT to keep.
        budget = ROOM * (cfg.tpot_ms / 1000 - step) * cfg.stall_tokens
        return (e.streams == 0 and given == 0) or given + cost <= budget

    d_ok = cfg.single_engine != "prefill" and fits(x.decode, x.decode_given, x.step_s)
    if x.prefill.pending > 0:
        return _behind_p(cfg, x, x.prefill, cost, d_ok)
    if d_ok:
        return RouteChoice.DECODE_ALONE
    p_step = x.prefill_step_s if x.prefill_step_s is not None else x.step_s
    if cfg.single_engine != "decode" and fits(x.prefill, x.prefill_given, p_step):
        return RouteChoice.PREFILL_ALONE
    return RouteChoice.PD


def _behind_p(
    cfg: AdaptiveConfig, x: Inputs, prefill: EngineLoad, cost: float, d_ok: bool
) -> RouteChoice:
    """The choice for a request that finds P (``prefill``, ``x.prefill``) computing prompts."""
    ttft = cfg.ttft_ms / 1000
    if (prefill.pending + 1) * cost <= KEEP_UP * ttft:
        return RouteChoice.PD
    # P falls behind: the shorter queue of prompts serves, D only within its budget; past
    # the TTFT target behind P, P/D loses the request anyway, so D's budget yields (a load
    # P cannot keep up with: two queues drain it, as two aggregated engines do).
    behind_d = x.decode.pending if x.decode is not None else 0
    shorter = x.decode is not None and behind_d < prefill.pending
    lost = (prefill.pending + 1) * cost > ttft
    if shorter and (d_ok or (lost and cfg.single_engine != "prefill")):
        return RouteChoice.DECODE_ALONE
    # P's queue is no longer than D's: with ``either``, P serves it whole where D decodes
    # more streams than P, so that both engines decode, as two aggregated engines do.
    if lost and cfg.single_engine == "either" and x.decode is not None:
        return RouteChoice.PREFILL_ALONE if prefill.streams < x.decode.streams else RouteChoice.PD
    return RouteChoice.PD


def decide(cfg: AdaptiveConfig, pool: ModelPool, prompt_tokens: int, now: float) -> RouteChoice:
    """The rule's choice for a request of ``prompt_tokens`` (estimated) arriving at ``pool``
    at ``now`` (monotonic seconds); the prompt's cost is recorded as given to the role that
    computes it (the pool's timings)."""
    x = inputs(cfg, pool, prompt_tokens, now)
    choice = choose(cfg, x)
    if x.prefill_s_per_token is not None:
        cost = prompt_tokens * x.prefill_s_per_token
        timings = pool.timings
        alone = choice is RouteChoice.DECODE_ALONE
        ledger = timings.given_decode if alone else timings.given_prefill
        ledger.add(now, cost)
    return choice


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


def inputs(cfg: AdaptiveConfig, pool: ModelPool, prompt_tokens: int, now: float) -> Inputs:
    """The rule's inputs for a request of ``prompt_tokens`` (estimated) to ``pool`` at
    ``now``."""
    timings = pool.timings
    life = life_s(cfg)

    def others(inst: Instance) -> int:
        return max(0, pool.load(inst) - inst.load)

    prefills = candidates(pool.prefill)
    decodes = candidates(pool.decode)
    return Inputs(
        prompt_tokens,
        timings.prefill_s_per_token,
        timings.step_s,
        _least([_prefill_load(p, others(p)) for p in prefills]),
        _least([_decode_load(d, others(d)) for d in decodes if d.free_slots > 0]),
        timings.given_prefill.within(now, life) / max(1, len(prefills)),
        timings.given_decode.within(now, life) / max(1, len(decodes)),
        timings.prefill_step_s,
    )
