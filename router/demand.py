"""Each role's demand in engines, at the model's targets: what an autoscaler scales P and D
on (``pdrouter_autoscale_desired_engines``; deploy/autoscaling has a KEDA ``ScaledObject``
and an HPA reading it).

- **P**: the prompt tokens this router sent to P per second over the last minute, times the
  seconds P takes per prompt token (the adaptive rule's estimate, measured on a P computing
  nothing else), is the number of P engines kept busy; divided by ``prefill_utilization``
  it is the number that keeps that headroom. 0 with no prompts; unknown (None) before the
  first prompt was timed.
- **D**: an engine's step time grows with the streams it decodes; taking it as
  proportional to them (from the one point measured: the recent step time at today's
  streams), an engine whose streams step in ``step_s`` holds ``tpot / step_s`` times as
  many at the target. So the engines needed are, summed over D engines, this router's share
  of each one's streams times ``step_s / tpot``. The proportional model overstates what
  fewer streams gain when most of a step is fixed cost: it errs towards more D. 0 with no
  streams; unknown without ``tpot_ms`` or before a stream's steps were timed.

Both are additive over router replicas and ``--workers`` (each counts its own prompts and
its own share of each engine's streams), so an autoscaler sums them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.engines.instance import Instance, Role, candidates

if TYPE_CHECKING:
    from router.registry import ModelPool

__all__ = ["Demand", "demands", "desired_or_nan"]


@dataclass(frozen=True, slots=True)
class Demand:
    role: Role
    engines: int  # routable now
    desired: float | None  # engines the load needs at the targets; None: not known yet


def demands(pool: ModelPool, now: float) -> list[Demand]:
    """P's demand (in modes that use P) and D's, at ``now`` (the dispatcher's clock)."""
    out = [_decode(pool)]
    if pool.mode.uses_prefill:
        out.insert(0, _prefill(pool, now))
    return out


def _prefill(pool: ModelPool, now: float) -> Demand:
    timings = pool.timings
    rate = timings.prefill_tokens.rate(now)
    per_token = timings.prefill_s_per_token
    engines = len(candidates(pool.prefill))
    if rate == 0:
        return Demand(Role.PREFILL, engines, 0.0)
    if per_token is None:
        return Demand(Role.PREFILL, engines, None)
    busy = rate * per_token
    return Demand(Role.PREFILL, engines, busy / pool.config.autoscaling.prefill_utilization)


def _decode(pool: ModelPool) -> Demand:
    routable = candidates(pool.decode)
    share = sum(_share(pool, d) for d in routable)
    tpot_ms = pool.config.autoscaling.tpot_ms
    step = pool.timings.step_s
    if share == 0:
        return Demand(Role.DECODE, len(routable), 0.0)
    if tpot_ms is None or step is None:
        return Demand(Role.DECODE, len(routable), None)
    return Demand(Role.DECODE, len(routable), share * step / (tpot_ms / 1000))


def _share(pool: ModelPool, d: Instance) -> float:
    """This router's part of ``d``'s streams (1 when it is alone on it)."""
    own = d.in_use
    if own == 0:
        return 0.0
    return own / max(own, pool.load(d))


def desired_or_nan(demand: Demand) -> float:
    """For a gauge: NaN where the demand is not known yet."""
    return math.nan if demand.desired is None else demand.desired
