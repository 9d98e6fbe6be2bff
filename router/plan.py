"""Capacity planning (``pd-router plan``): from a load (a request trace, or a rate and mean
lengths) and measured engine timings, the fewest P and D engines, and the fewest aggregated
engines, that meet a TTFT and a TPOT target, with the TTFT and TPOT each is predicted to give.

The model (docs/planning.md), every engine alike, requests spread evenly:

- **Prefill**: a prompt of ``L`` tokens takes ``S = prefill_fixed_s + prefill_s_per_token * L
  + prefill_s_per_token2 * L²`` on P (the square: attention, which long prompts feel). P works
  on prompts one after another (their work adds up whether or not a step batches several, so
  batching does not shorten the sum: the prompts are the queue's jobs). The P engines are one
  queue with ``p`` servers, a GI/G/c queue, whose mean wait is Allen-Cunneen's approximation:
  the M/M/c wait (Erlang C) times ``(ca² + cs²) / 2``, ``ca²`` the squared coefficient of
  variation of the trace's gaps between arrivals (1 for Poisson arrivals, and without a
  trace), ``cs²`` that of ``S``. For one server and Poisson arrivals it is exactly
  Pollaczek-Khinchine's M/G/1 wait. The wait's tail is taken as exponential:
  ``P(W > t) = C exp(-t C / W)``, ``C`` the probability of waiting at all (Erlang C).
- **Handoff**: ``handoff_s`` (the KV transfer and what the router adds, measured), D's
  admission of the request (``admit``: reading its KV, computing its first token) and the
  step D is in when it arrives.
- **Decode**: a D engine's step takes ``step_fixed_s + step_per_stream_s * B`` with ``B``
  streams; every stream gets one token a step, and waits while D admits a new request, which
  takes ``rho_admit = r E[admit]`` of D's time: ``TPOT = step(B) / (1 - rho_admit)``. By
  Little's law a D receiving ``r`` requests a second of mean ``O`` output tokens holds
  ``B = r O TPOT`` streams: ``B = r O s0 / (1 - rho_admit - r O s1)``, finite while that
  denominator is positive (and ``B`` within ``max_streams``).
- **Aggregated** (for comparison): each engine interleaves prompts with its streams. Prompts are
  the same GI/G/c queue over the ``n`` engines, whose service is the prompt and the step it
  rides in (``S + step(B)``), a new prompt waits half a step for the current one; the streams
  get the time prompts leave, ``TPOT = step(B) / (1 - rho_prefill)``, and ``B = r O TPOT``.

TTFT is predicted as its mean and at a quantile (the wait's quantile plus the trace's prompt
quantile: a sum of quantiles, so it errs high); TPOT as its mean and a request's at the
quantile (D: the step at the quantile of its streams, Poisson; aggregated: the stalls of the
prompts a stream meets, Poisson). A configuration meets the SLO when TTFT and TPOT at the
quantile are within their targets. Pure functions, no I/O beyond parsing the texts given.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from statistics import NormalDist

from prometheus_client.parser import text_string_to_metric_families

__all__ = [
    "Load",
    "Plan",
    "PlanError",
    "Prediction",
    "Slo",
    "Timings",
    "aggregated",
    "best_split",
    "describe",
    "disaggregated",
    "load_from_trace",
    "max_rate",
    "plan",
    "poisson_quantile",
    "prediction_json",
    "rate_from_scrapes",
    "render_text",
    "shape",
    "steady_load",
    "timings_from_json",
]

INFEASIBLE = math.inf


class PlanError(ValueError):
    """A trace, timings file or argument the planner cannot use (the message says which)."""


@dataclass(frozen=True, slots=True)
class Timings:
    """One engine's measured times (seconds). ``handoff_s``: a disaggregated request's TTFT
    beyond P's prefill, D's admission and one step (KV transfer, the router), measured in
    ``mode``. ``admit``: D's time to take in a new request (read its KV, compute its first
    token), during which its other streams wait: ``admit_fixed_s + admit_s_per_token * L``."""

    prefill_fixed_s: float
    prefill_s_per_token: float
    step_fixed_s: float
    step_per_stream_s: float
    handoff_s: float = 0.0
    prefill_s_per_token2: float = 0.0
    max_streams: int | None = None
    mode: str = "pull"
    admit_fixed_s: float = 0.0
    admit_s_per_token: float = 0.0

    def admit_s(self, tokens: float) -> float:
        return self.admit_fixed_s + self.admit_s_per_token * tokens

    def prefill_s(self, tokens: float) -> float:
        return (
            self.prefill_fixed_s
            + self.prefill_s_per_token * tokens
            + self.prefill_s_per_token2 * tokens * tokens
        )

    def step_s(self, streams: float) -> float:
        return self.step_fixed_s + self.step_per_stream_s * streams


@dataclass(frozen=True, slots=True)
class Load:
    """Requests a second, and each request's prompt and output tokens (a sample of them)."""

    rate: float
    prompts: tuple[int, ...]
    outputs: tuple[int, ...]
    arrival_cv2: float = 1.0  # squared coefficient of variation of the gaps (1: Poisson)

    @property
    def output_mean(self) -> float:
        return sum(self.outputs) / len(self.outputs)

    @property
    def prompt_mean(self) -> float:
        return sum(self.prompts) / len(self.prompts)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tpot_s: float
    quantile: float = 0.9  # TTFT is checked at this quantile


@dataclass(frozen=True, slots=True)
class Prediction:
    """One configuration's predicted latencies (seconds; ``inf``: the load outruns it)."""

    mode: str  # "disaggregated" or "aggregated"
    prefill_engines: int
    decode_engines: int  # aggregated: the engines, which also prefill
    ttft_mean_s: float
    ttft_quantile_s: float
    tpot_s: float
    tpot_quantile_s: float  # a request's TPOT (its mean over its tokens) at the quantile
    prefill_utilization: float
    streams_per_decode: float

    @property
    def engines(self) -> int:
        if self.mode == "aggregated":
            return self.decode_engines
        return self.prefill_engines + self.decode_engines

    def meets(self, slo: Slo) -> bool:
        return self.ttft_quantile_s <= slo.ttft_s and self.tpot_quantile_s <= slo.tpot_s


@dataclass(frozen=True, slots=True)
class Plan:
    slo: Slo
    disaggregated: Prediction | None  # the fewest P+D that meet the SLO; None: none does
    aggregated: Prediction | None
    recommended: str  # "disaggregated", "aggregated" or "none"

    def to_json(self, load: Load, timings: Timings) -> dict[str, object]:
        """A JSON-able document (an infinite time, a load the shape cannot carry: null)."""

        def pred(p: Prediction | None) -> dict[str, object] | None:
            return None if p is None else prediction_json(p)

        return {
            "recommended": self.recommended,
            "disaggregated": pred(self.disaggregated),
            "aggregated": pred(self.aggregated),
            "slo": asdict(self.slo),
            "load": {
                "rate": load.rate,
                "requests": len(load.prompts),
                "prompt_tokens_mean": load.prompt_mean,
                "output_tokens_mean": load.output_mean,
                "arrival_cv2": load.arrival_cv2,
            },
            "timings": asdict(timings),
        }


def prediction_json(p: Prediction) -> dict[str, object]:
    """``p`` as JSON-able values, an infinite figure as None (JSON has no infinity)."""
    return {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in asdict(p).items()}


# -- inputs -----------------------------------------------------------------------------------


def load_from_trace(lines: Iterable[str]) -> Load:
    """A JSONL trace: one request a line, ``{"arrival_s": float, "prompt_tokens": int,
    "output_tokens": int}`` (blank lines skipped). The rate is the requests over the span of
    arrivals; at least two requests with distinct arrival times are needed."""
    rows: list[tuple[float, int, int]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            row = (float(rec["arrival_s"]), int(rec["prompt_tokens"]), int(rec["output_tokens"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise PlanError(f"trace line {number}: {exc!s} (want arrival_s, prompt_tokens, "
                            "output_tokens)") from None  # fmt: skip
        if row[1] < 0 or row[2] < 1 or not math.isfinite(row[0]):
            raise PlanError(f"trace line {number}: tokens out of range or arrival not finite")
        rows.append(row)
    rows.sort()
    if len(rows) < 2 or rows[-1][0] <= rows[0][0]:
        raise PlanError("trace: need at least two requests arriving at different times")
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(rows)]
    mean_gap = sum(gaps) / len(gaps)
    cv2 = _variance(gaps) / mean_gap**2 if len(gaps) >= 2 else 1.0
    return Load(
        rate=1 / mean_gap,
        prompts=tuple(r[1] for r in rows),
        outputs=tuple(r[2] for r in rows),
        arrival_cv2=cv2,
    )


def steady_load(rate: float, prompt_tokens: int, output_tokens: int) -> Load:
    """Poisson arrivals at ``rate`` of requests all alike."""
    if rate <= 0 or prompt_tokens < 0 or output_tokens < 1:
        raise PlanError("want a rate above 0, prompt tokens >= 0 and output tokens >= 1")
    return Load(rate=rate, prompts=(prompt_tokens,), outputs=(output_tokens,))


def rate_from_scrapes(before: str, after: str, seconds: float, model: str | None) -> float:
    """Requests a second between two scrapes of the router's /metrics, ``seconds`` apart:
    the growth of ``pdrouter_requests_total`` (every outcome; ``model``'s, or every model's)."""
    if seconds <= 0:
        raise PlanError("the scrapes must be some seconds apart")
    grown = _requests(after, model) - _requests(before, model)
    if grown < 0:
        raise PlanError("the router restarted between the scrapes (its counter went down)")
    return grown / seconds


def _requests(text: str, model: str | None) -> float:
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise PlanError(f"not a Prometheus text page: {exc!s}") from None
    return sum(
        sample.value
        for family in families  # the family's name differs by the exposition format
        for sample in family.samples
        if sample.name == "pdrouter_requests_total"
        and (model is None or sample.labels.get("model") == model)
    )


def timings_from_json(text: str) -> Timings:
    """The timings file: ``prefill_fixed_s`` and ``prefill_s_per_token`` (and optionally
    ``prefill_s_per_token2``), or ``prefill_s_by_tokens`` (``{"tokens": seconds, ...}``,
    fitted by least squares: a line, with a square term from three lengths on where the
    fit gives it a positive weight);
    ``step_fixed_s`` and ``step_per_stream_s``, or ``step_s_by_streams`` (likewise); optional
    ``handoff_s``, ``max_streams``, ``mode``, and D's admission: ``admit_fixed_s`` and
    ``admit_s_per_token`` or ``admit_s_by_tokens`` (default 0: streams never wait for one)."""
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise PlanError("timings: not a JSON object")
        a, b, c = _prefill(doc)
        s0, s1 = _line(doc, "step_fixed_s", "step_per_stream_s", "step_s_by_streams")
        cap = doc.get("max_streams")
        admit = (0.0, 0.0)
        if any(k in doc for k in ("admit_fixed_s", "admit_s_per_token", "admit_s_by_tokens")):
            admit = _line(doc, "admit_fixed_s", "admit_s_per_token", "admit_s_by_tokens")
        timings = Timings(
            prefill_fixed_s=max(0.0, a),
            prefill_s_per_token=b,
            prefill_s_per_token2=c,
            step_fixed_s=max(0.0, s0),
            step_per_stream_s=max(0.0, s1),
            handoff_s=float(doc.get("handoff_s", 0.0)),
            max_streams=None if cap is None else int(cap),
            mode=str(doc.get("mode", "pull")),
            admit_fixed_s=max(0.0, admit[0]),
            admit_s_per_token=max(0.0, admit[1]),
        )
    except (ValueError, TypeError) as exc:
        raise PlanError(f"timings: {exc!s}") from None
    if timings.prefill_s_per_token <= 0 and timings.prefill_fixed_s <= 0:
        raise PlanError("timings: a prompt must take some time")
    if timings.step_s(1) <= 0:
        raise PlanError("timings: a decode step must take some time")
    return timings


def _prefill(doc: Mapping[str, object]) -> tuple[float, float, float]:
    raw = doc.get("prefill_s_by_tokens")
    if isinstance(raw, dict) and len(raw) >= 3:
        a, b, c = fit_quadratic([(float(x), float(y)) for x, y in raw.items()])
        if c > 0:
            return a, b, c
    a, b = _line(doc, "prefill_fixed_s", "prefill_s_per_token", "prefill_s_by_tokens")
    given = doc.get("prefill_s_per_token2", 0.0)
    square = 0.0 if "prefill_s_by_tokens" in doc else float(given)  # type: ignore[arg-type]
    return a, b, square


def fit_quadratic(points: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x + c x²``: ``(a, b, c)`` (the normal equations, by
    Cramer's rule: three unknowns)."""
    scale = max(abs(x) for x, _ in points) or 1.0  # x in [-1, 1]: the sums stay conditioned
    scaled = [(x / scale, y) for x, y in points]
    sums = [sum(x**k for x, _ in scaled) for k in range(5)]
    rhs = [sum(y * x**k for x, y in scaled) for k in range(3)]
    m = [[sums[i + j] for j in range(3)] for i in range(3)]
    det = _det3(m)
    if det == 0:
        raise PlanError("need points at three different sizes to fit a square")
    out = []
    for col in range(3):
        mc = [[rhs[i] if j == col else m[i][j] for j in range(3)] for i in range(3)]
        out.append(_det3(mc) / det)
    return out[0], out[1] / scale, out[2] / scale**2


def _det3(m: Sequence[Sequence[float]]) -> float:
    return (
        m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
        - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
        + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
    )


def _line(doc: Mapping[str, object], fixed: str, slope: str, points: str) -> tuple[float, float]:
    if points in doc:
        raw = doc[points]
        if not isinstance(raw, dict) or len(raw) < 2:
            raise PlanError(f"{points}: want at least two points, {{x: seconds}}")
        return fit_line([(float(x), float(y)) for x, y in raw.items()])
    if fixed not in doc or slope not in doc:
        raise PlanError(f"want {fixed} and {slope}, or {points}")
    return float(doc[fixed]), float(doc[slope])  # type: ignore[arg-type]


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``: ``(a, b)``."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        raise PlanError("need points at two different sizes to fit a line")
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


# -- the queueing model -----------------------------------------------------------------------


def _variance(xs: Sequence[float]) -> float:
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)


def _quantile(xs: Sequence[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def erlang_c(servers: int, offered: float) -> float:
    """The probability an arrival waits in an M/M/c queue with ``offered`` = lambda E[S]: from
    Erlang B's recursion, which stays within floats for any number of servers."""
    if offered >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    rho = offered / servers
    return b / (1 - rho * (1 - b))


@dataclass(frozen=True, slots=True)
class _Queue:
    wait_mean: float
    wait_quantile: float
    utilization: float


def _queue(rate: float, services: Sequence[float], servers: int, ca2: float, q: float) -> _Queue:
    """GI/G/c wait (Allen-Cunneen) for ``services`` (a sample of service times)."""
    mean = sum(services) / len(services)
    rho = rate * mean / servers
    if rho >= 1:
        return _Queue(INFEASIBLE, INFEASIBLE, rho)
    cs2 = _variance(services) / mean**2 if mean > 0 else 0.0
    waits = erlang_c(servers, rate * mean)
    wait = waits / (servers / mean - rate) * (ca2 + cs2) / 2
    tail = 0.0 if waits <= 1 - q or wait == 0 else wait / waits * math.log(waits / (1 - q))
    return _Queue(wait, tail, rho)


def _decode_streams(rate: float, output_mean: float, s0: float, s1: float, busy: float) -> float:
    """``B = rate O step(B) / (1 - busy)``, solved for B (inf when it does not converge)."""
    spare = (1 - busy) - rate * output_mean * s1
    if spare <= 0:
        return INFEASIBLE
    return rate * output_mean * s0 / spare


def disaggregated(load: Load, t: Timings, prefill: int, decode: int, q: float) -> Prediction:
    """``prefill`` P engines and ``decode`` D engines under ``load``."""
    rate = load.rate / decode
    admits = [t.admit_s(n) for n in load.prompts]
    admit_mean = sum(admits) / len(admits)
    busy = rate * admit_mean  # the share of D's time spent taking in new requests
    streams = _decode_streams(rate, load.output_mean, *_step(t), busy=busy)
    if t.max_streams is not None and streams > t.max_streams:
        streams = INFEASIBLE
    step = t.step_s(streams)
    tpot = step / (1 - busy) if busy < 1 else INFEASIBLE
    # D's streams are an M/G/inf system: their number is Poisson; a request's TPOT is taken
    # as the step at that number's quantile (it averages over its life: errs high), plus the
    # admissions it waits through (Poisson: D's arrivals during its life).
    met = poisson_quantile(rate * load.output_mean * tpot, q)
    tpot_q = t.step_s(poisson_quantile(streams, q)) + met * admit_mean / load.output_mean
    services = [t.prefill_s(n) for n in load.prompts]
    queue = _queue(load.rate, services, prefill, load.arrival_cv2, q)
    # After P: the handoff, D's admission of it, and the step D is in when it arrives.
    first = [s + a + t.handoff_s + step for s, a in zip(services, admits, strict=True)]
    return Prediction(
        mode="disaggregated",
        prefill_engines=prefill,
        decode_engines=decode,
        ttft_mean_s=queue.wait_mean + sum(first) / len(first),
        ttft_quantile_s=queue.wait_quantile + _quantile(first, q),
        tpot_s=tpot,
        tpot_quantile_s=tpot_q,
        prefill_utilization=queue.utilization,
        streams_per_decode=streams,
    )


def aggregated(load: Load, t: Timings, engines: int, q: float) -> Prediction:
    """``engines`` engines, each prefilling and decoding its share of ``load``."""
    rate = load.rate / engines
    services = [t.prefill_s(n) for n in load.prompts]
    busy = rate * sum(services) / len(services)  # the share of time spent on prompts
    streams = INFEASIBLE if busy >= 1 else _decode_streams(rate, load.output_mean, *_step(t), busy)
    if t.max_streams is not None and streams > t.max_streams:
        streams = INFEASIBLE
    step = t.step_s(streams)
    tpot = step / (1 - busy) if busy < 1 else INFEASIBLE
    riding = [s + step for s in services]  # a prompt rides in a step with the streams
    queue = _queue(load.rate, riding, engines, load.arrival_cv2, q)  # pooled, as P's
    mean_s = sum(riding) / len(riding)
    # A stream is stalled by the prompts its engine computes during its life: K of them,
    # Poisson with mean rate x its life (O x TPOT), each adding E[S] / O to its TPOT.
    met = poisson_quantile(rate * load.output_mean * tpot, q)
    tpot_q = step + met * sum(services) / len(services) / load.output_mean
    return Prediction(
        mode="aggregated",
        prefill_engines=0,
        decode_engines=engines,
        ttft_mean_s=queue.wait_mean + mean_s + step / 2,
        ttft_quantile_s=queue.wait_quantile + _quantile(riding, q) + step / 2,
        tpot_s=tpot,
        tpot_quantile_s=tpot_q,
        prefill_utilization=queue.utilization,
        streams_per_decode=streams,
    )


def poisson_quantile(mean: float, q: float) -> float:
    """The smallest k with P(X <= k) >= q for X Poisson of ``mean`` (a normal approximation
    beyond a mean of 400; inf for an infinite mean)."""
    if math.isinf(mean) or math.isnan(mean):
        return INFEASIBLE
    if mean > 400:
        return math.ceil(mean + NormalDist().inv_cdf(q) * math.sqrt(mean))
    term = total = math.exp(-mean)
    k = 0
    while total < q:
        k += 1
        term *= mean / k
        total += term
    return float(k)


def _step(t: Timings) -> tuple[float, float]:
    return t.step_fixed_s, t.step_per_stream_s


def plan(load: Load, timings: Timings, slo: Slo, max_engines: int = 1024) -> Plan:
    """The fewest engines meeting ``slo`` in each mode (up to ``max_engines`` of a role).

    Disaggregated: the fewest D whose TPOT meets the target, then the fewest P whose TTFT
    does with them (P's count does not change D's; D's batch adds one step to TTFT).
    Recommended: the mode with fewer engines; a tie goes to aggregated (fewer parts)."""
    q = slo.quantile
    pd: Prediction | None = None
    decode = _fewest(
        lambda d: disaggregated(load, timings, 1, d, q).tpot_quantile_s <= slo.tpot_s, max_engines
    )
    if decode is not None:
        prefill = _fewest(
            lambda p: disaggregated(load, timings, p, decode, q).meets(slo), max_engines
        )
        if prefill is not None:
            pd = disaggregated(load, timings, prefill, decode, q)
    agg_n = _fewest(lambda n: aggregated(load, timings, n, q).meets(slo), max_engines)
    agg = None if agg_n is None else aggregated(load, timings, agg_n, q)
    if pd is None and agg is None:
        choice = "none"
    elif agg is None or (pd is not None and pd.engines < agg.engines):
        choice = "disaggregated"
    else:
        choice = "aggregated"
    return Plan(slo=slo, disaggregated=pd, aggregated=agg, recommended=choice)


def _fewest(ok: Callable[[int], bool], limit: int) -> int | None:
    """The smallest n in 1..limit with ``ok(n)``, assuming ``ok`` stays true above it."""
    lo, hi = 1, 1
    while not ok(hi):  # doubling, then bisection: O(log limit) evaluations
        if hi >= limit:
            return None
        lo, hi = hi + 1, min(limit, hi * 2)
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


# -- capacity at the SLO ----------------------------------------------------------------------

Predict = Callable[[Load], Prediction]


def shape(text: str) -> Callable[[Load, Timings, float], Prediction]:
    """``8P8D`` (disaggregated) or ``16A`` (aggregated): the prediction of that shape."""
    spec = text.strip().upper()
    try:
        if spec.endswith("A"):
            n = int(spec[:-1])
            if n >= 1:
                return lambda load, t, q: aggregated(load, t, n, q)
        elif spec.endswith("D") and "P" in spec:
            p, _, d = spec.removesuffix("D").partition("P")
            pn, dn = int(p), int(d)
            if pn >= 1 and dn >= 1:
                return lambda load, t, q: disaggregated(load, t, pn, dn, q)
    except ValueError:
        pass
    raise PlanError(f"{text!r}: want a shape such as 1P1D or 2A")


def max_rate(load: Load, predict: Predict, slo: Slo) -> float:
    """The highest rate (requests a second, the load's lengths and burstiness kept) at which
    ``predict`` still meets ``slo``; 0 when none does. Bisection to 0.1%."""

    def ok(rate: float) -> bool:
        return predict(replace(load, rate=rate)).meets(slo)

    hi = max(load.rate, 1e-3)
    while ok(hi):
        hi *= 2
        if hi > 1e9:
            return math.inf
    lo = 0.0
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def best_split(load: Load, t: Timings, slo: Slo, engines: int) -> tuple[int, int, float]:
    """Of ``engines`` engines split into P and D: the split that carries the highest rate at
    ``slo``, as ``(P, D, rate)``."""
    if engines < 2:
        raise PlanError("a split needs two engines at least")
    best = (1, engines - 1, -1.0)
    for p in range(1, engines):

        def predict(x: Load, p: int = p) -> Prediction:
            return disaggregated(x, t, p, engines - p, slo.quantile)

        rate = max_rate(load, predict, slo)
        if rate > best[2]:
            best = (p, engines - p, rate)
    return best


# -- output -----------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds * 1000:,.0f} ms"


def describe(p: Prediction, quantile: float) -> str:
    shape = (
        f"{p.prefill_engines}P{p.decode_engines}D"
        if p.mode == "disaggregated"
        else f"{p.decode_engines} aggregated"
    )
    return (
        f"{shape} ({p.engines} engines): TTFT mean {_ms(p.ttft_mean_s)}, "
        f"p{quantile * 100:g} {_ms(p.ttft_quantile_s)}; TPOT mean {_ms(p.tpot_s)}, "
        f"p{quantile * 100:g} {_ms(p.tpot_quantile_s)}; "
        f"prefill utilization {p.prefill_utilization:.2f}, {p.streams_per_decode:.1f} streams "
        "an engine"
    )


def render_text(result: Plan, load: Load, timings: Timings) -> str:
    q = result.slo.quantile
    lines = [
        f"load: {load.rate:.3g} req/s, prompts {load.prompt_mean:,.0f} tokens, outputs "
        f"{load.output_mean:,.0f} tokens (mean of {len(load.prompts)}), arrival cv² "
        f"{load.arrival_cv2:.2f}",
        f"SLO: TTFT p{q * 100:g} <= {_ms(result.slo.ttft_s)}, "
        f"TPOT p{q * 100:g} <= {_ms(result.slo.tpot_s)}",
    ]
    pd, agg = result.disaggregated, result.aggregated
    lines.append(
        f"disaggregated ({timings.mode}): " + (describe(pd, q) if pd else "no count meets the SLO")
    )
    lines.append("aggregated: " + (describe(agg, q) if agg else "no count meets the SLO"))
    lines.append(f"recommended: {result.recommended}")
    return "\n".join(lines)
