"""The adaptive rule (router/pd/adaptive.py): each branch on inputs given by the test, the
inputs read from a model's pool, and the timings and ledgers it learns from
(router/engines/timings.py).

Defaults of the rule here: TTFT 1,500 ms, TPOT 40 ms, a stream's life of 64 tokens (2.56 s at
the SLO); a 1,000-token prompt at 1 ms a token costs 1 s on one engine. At a 20 ms step an
engine's budget is 0.75 x 20 ms x 64 = 0.96 s of prompts a life; at 10 ms, 1.44 s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from router.config import AdaptiveConfig, parse_config
from router.engines.instance import Instance
from router.engines.timings import WEIGHT, PromptLedger, Timings
from router.errors import RouteChoice
from router.metrics import ROUTE_CHOICES
from router.pd.adaptive import EngineLoad, Inputs, choose, decide, inputs, life_s
from router.registry import Registry

# Most tests below read the rule with both engines allowed to serve alone.
CFG = AdaptiveConfig(enabled=True, single_engine="either")
IDLE = EngineLoad(streams=0, pending=0)
MS = 0.001


def _inputs(
    prefill: EngineLoad | None = IDLE,
    decode: EngineLoad | None = IDLE,
    *,
    tokens: int = 1000,
    per_token: float | None = 1 * MS,
    step: float | None = 20 * MS,
    given_p: float = 0.0,
    given_d: float = 0.0,
) -> Inputs:
    return Inputs(tokens, per_token, step, prefill, decode, given_p, given_d)


def _cfg(**kw: Any) -> AdaptiveConfig:
    return AdaptiveConfig(enabled=True, **({"single_engine": "either"} | kw))


def test_by_default_p_only_prefills() -> None:
    """D's decodes are busy and P idle: with ``either`` P would serve this one alone; by
    default P keeps to prefills (a stream P serves alone stalls behind every later prompt)."""
    d_decodes = EngineLoad(streams=1, pending=0)
    x = _inputs(decode=d_decodes, tokens=500, given_d=0.6)  # D over its budget
    assert choose(CFG, x) is RouteChoice.PREFILL_ALONE
    assert choose(AdaptiveConfig(enabled=True), x) is RouteChoice.PD


def test_both_engines_idle_one_engine_serves_and_a_tie_goes_to_d() -> None:
    assert choose(CFG, _inputs()) is RouteChoice.DECODE_ALONE


def test_without_timings_the_static_mode_serves_and_teaches_them() -> None:
    assert choose(CFG, _inputs(per_token=None)) is RouteChoice.PD
    assert choose(CFG, _inputs(step=None)) is RouteChoice.PD


def test_while_p_keeps_up_with_its_prompts_p_d_serves_even_with_d_idle() -> None:
    """P computes a prompt, and this one would be done behind it within half the TTFT
    target (2 x 0.3 s <= 0.75 s): D's streams are kept clean of prompts."""
    busy_p = EngineLoad(streams=0, pending=1)
    assert choose(CFG, _inputs(prefill=busy_p, tokens=300)) is RouteChoice.PD
    assert choose(CFG, _inputs(prefill=busy_p, tokens=400)) is RouteChoice.DECODE_ALONE  # 0.8 s


def test_when_p_falls_behind_d_serves_alone_within_its_budget() -> None:
    """P would finish this 1 s prompt after 2 s, within a 3 s target but past half of it: D
    computes it if it has fewer queued and the prompts it was given in the last life, this
    one too, stay within its budget."""
    cfg = _cfg(ttft_ms=3000)
    busy_p = EngineLoad(streams=0, pending=1)
    assert choose(cfg, _inputs(prefill=busy_p)) is RouteChoice.DECODE_ALONE
    d_streams = EngineLoad(streams=3, pending=0)
    assert choose(cfg, _inputs(busy_p, d_streams, step=20 * MS)) is RouteChoice.PD  # 1 > 0.96
    assert choose(cfg, _inputs(busy_p, d_streams, step=10 * MS)) is RouteChoice.DECODE_ALONE
    given = _inputs(busy_p, d_streams, step=10 * MS, given_d=0.5)  # 1.5 > 1.44
    assert choose(cfg, given) is RouteChoice.PD
    d_prompt = EngineLoad(streams=0, pending=1)  # as many queued on D as on P
    assert choose(cfg, _inputs(busy_p, d_prompt)) is RouteChoice.PD
    assert choose(_cfg(ttft_ms=3000, single_engine="prefill"), _inputs(busy_p)) is RouteChoice.PD


def test_a_request_p_d_would_lose_goes_to_d_past_its_budget() -> None:
    """P has two 0.6 s prompts queued: this one would be done after 1.8 s, past the 1.5 s
    target, so D computes it though its streams' budget is spent; with one queued (1.2 s)
    D's budget still holds it back."""
    d_streams = EngineLoad(streams=3, pending=0)
    spent = _inputs(EngineLoad(streams=0, pending=2), d_streams, tokens=600, given_d=1.0)
    assert choose(CFG, spent) is RouteChoice.DECODE_ALONE
    within = _inputs(EngineLoad(streams=0, pending=1), d_streams, tokens=600, given_d=1.0)
    assert choose(CFG, within) is RouteChoice.PD
    assert choose(_cfg(single_engine="prefill"), spent) is RouteChoice.PD


def test_past_the_target_on_both_engines_the_shorter_queue_serves() -> None:
    """P has three 0.6 s prompts queued, D two: the TTFT target is lost on either (2.4 s
    and 1.8 s), and D's shorter queue serves; with D's queue as long as P's, P/D does."""
    d_busy = EngineLoad(streams=3, pending=2)
    p_busy = EngineLoad(streams=0, pending=3)
    x = _inputs(p_busy, d_busy, tokens=600, given_d=1.0)
    assert choose(CFG, x) is RouteChoice.DECODE_ALONE
    level = _inputs(p_busy, EngineLoad(streams=3, pending=3), tokens=600, given_d=1.0)
    assert choose(_cfg(single_engine="decode"), level) is RouteChoice.PD


def test_past_the_target_p_serves_alone_where_d_decodes_more() -> None:
    """Both queues hold three 0.6 s prompts, D decodes three streams and P one: with
    ``either`` P serves this one whole (both engines decode, as two aggregated engines do);
    once P decodes as many as D, P/D serves."""
    level = _inputs(EngineLoad(streams=1, pending=3), EngineLoad(streams=3, pending=3), tokens=600)
    assert choose(CFG, level) is RouteChoice.PREFILL_ALONE
    even = _inputs(EngineLoad(streams=3, pending=3), EngineLoad(streams=3, pending=3), tokens=600)
    assert choose(CFG, even) is RouteChoice.PD


def test_no_routable_p_leaves_the_request_to_the_static_mode() -> None:
    assert choose(CFG, _inputs(prefill=None)) is RouteChoice.PD


def test_d_serves_alone_first_and_p_only_where_d_does_not_fit() -> None:
    """D decodes a stream, P nothing: D still serves alone (every prompt D computes is one
    the rule gave it); P does once D is over its budget."""
    d_decodes = EngineLoad(streams=1, pending=0)
    assert choose(CFG, _inputs(decode=d_decodes, tokens=500)) is RouteChoice.DECODE_ALONE
    x = _inputs(decode=d_decodes, tokens=500, given_d=0.6)  # 1.1 > 0.96
    assert choose(CFG, x) is RouteChoice.PREFILL_ALONE


def test_the_budget_is_the_tpot_slack_of_a_stream_s_life() -> None:
    """A stream of stall_tokens tokens at step s may wait ROOM x (tpot - s) x stall_tokens for
    prompts: 0.75 x 20 ms x 50 = 0.75 s at a 20 ms step, under this 0.8 s prompt; 0.9 s at
    a 16 ms step, over it."""
    streams = EngineLoad(streams=3, pending=0)
    only_d = _cfg(single_engine="decode", stall_tokens=50)
    x = _inputs(decode=streams, tokens=800, step=16 * MS)
    assert choose(only_d, x) is RouteChoice.DECODE_ALONE
    x = _inputs(decode=streams, tokens=800, step=20 * MS)
    assert choose(only_d, x) is RouteChoice.PD


def test_an_idle_engine_given_nothing_lately_has_no_tpot_to_keep() -> None:
    """A step time far over TPOT does not matter to an engine that decodes nothing and was
    given no prompt in the last life; one given a prompt there has streams coming."""
    assert choose(CFG, _inputs(step=500 * MS)) is RouteChoice.DECODE_ALONE
    assert choose(CFG, _inputs(step=500 * MS, given_d=0.1, given_p=0.1)) is RouteChoice.PD


def test_a_prompt_over_the_ttft_on_one_engine_goes_p_d() -> None:
    assert choose(CFG, _inputs(tokens=1500)) is RouteChoice.DECODE_ALONE  # 1.5 s: at the target
    assert choose(CFG, _inputs(tokens=1501)) is RouteChoice.PD


def test_prompts_pending_on_d_count_in_this_one_s_ttft() -> None:
    """D has one prompt of its own to compute: this one would start after it (2 x 1 s over
    a 1.5 s TTFT), so the idle P serves it."""
    d_prefills = EngineLoad(streams=0, pending=1)
    assert choose(CFG, _inputs(decode=d_prefills)) is RouteChoice.PREFILL_ALONE
    assert choose(_cfg(single_engine="decode"), _inputs(decode=d_prefills)) is RouteChoice.PD


def test_single_engine_limits_which_engine_may_serve_alone() -> None:
    assert choose(_cfg(single_engine="prefill"), _inputs()) is RouteChoice.PREFILL_ALONE
    d_decodes = EngineLoad(streams=1, pending=0)
    x = _inputs(decode=d_decodes, tokens=500)
    assert choose(_cfg(single_engine="decode"), x) is RouteChoice.DECODE_ALONE


def test_no_free_decode_slot_leaves_p_alone_or_p_d() -> None:
    assert choose(CFG, _inputs(decode=None)) is RouteChoice.PREFILL_ALONE
    assert choose(_cfg(single_engine="decode"), _inputs(decode=None)) is RouteChoice.PD


def test_low_load_goes_to_one_engine_and_high_load_to_p_d() -> None:
    """The rule's direction: the same prompt and timings, one engine at idle, P/D once both
    engines decode streams and were given prompts up to their budgets."""
    assert choose(CFG, _inputs(tokens=500)) is not RouteChoice.PD
    loaded = EngineLoad(streams=4, pending=0)
    x = _inputs(loaded, loaded, tokens=500, given_p=0.5, given_d=0.5)  # 0.5 + 0.5 > 0.96
    assert choose(CFG, x) is RouteChoice.PD


def test_prompts_given_to_p_would_stall_a_stream_served_there_alone() -> None:
    """D over its budget; P idle at this instant, but given 0.6 s of P/D prompts in the last
    life: a stream it served alone would wait behind them and this one (1.1 s > 0.96 s), so
    P/D; with 0.3 s given, P serves it."""
    d_decodes = EngineLoad(streams=1, pending=0)
    x = _inputs(decode=d_decodes, tokens=500, given_d=0.6, given_p=0.3)
    assert choose(CFG, x) is RouteChoice.PREFILL_ALONE
    x = _inputs(decode=d_decodes, tokens=500, given_d=0.6, given_p=0.6)
    assert choose(CFG, x) is RouteChoice.PD


def test_p_s_budget_is_of_the_streams_p_served_alone() -> None:
    """Slow P-alone streams (35 ms: a 0.24 s budget) do not shrink D's budget, nor do D's
    streams stand for P's once P has served one."""
    streams = EngineLoad(streams=1, pending=0)
    x = Inputs(500, 1 * MS, 20 * MS, streams, streams, 0.1, 0.6, prefill_step_s=35 * MS)
    assert choose(CFG, x) is RouteChoice.PD  # D: 0.6 + 0.5 > 0.96; P: 0.1 + 0.5 > 0.24
    x = Inputs(500, 1 * MS, 20 * MS, streams, streams, 0.1, 0.4, prefill_step_s=35 * MS)
    assert choose(CFG, x) is RouteChoice.DECODE_ALONE  # D: 0.9 <= 0.96
    x = Inputs(500, 1 * MS, 20 * MS, streams, streams, 0.1, 0.6)
    assert choose(CFG, x) is RouteChoice.PREFILL_ALONE  # P with D's step: 0.6 <= 0.96


def test_the_counter_s_labels_are_the_rule_s_choices() -> None:
    assert set(ROUTE_CHOICES) == {c.value for c in RouteChoice}


# -- timings ---------------------------------------------------------------------------


def test_timings_start_unknown_then_follow_recent_observations() -> None:
    t = Timings()
    assert (t.prefill_s_per_token, t.step_s) == (None, None)
    t.observe_prefill(2.0, 1000)
    t.observe_stream(1.0, 50)
    assert (t.prefill_s_per_token, t.step_s) == (pytest.approx(0.002), pytest.approx(0.02))
    t.observe_prefill(4.0, 1000)
    assert t.prefill_s_per_token == pytest.approx(0.002 + WEIGHT * 0.002)


def test_a_ledger_sums_what_was_given_within_a_window() -> None:
    ledger = PromptLedger()
    assert ledger.within(0.0, 1.0) == 0.0
    ledger.add(0.0, 1.0)
    ledger.add(1.0, 0.5)
    assert ledger.within(1.0, 2.0) == pytest.approx(1.5)
    assert ledger.within(1.5, 1.0) == pytest.approx(0.5)  # the first is out of the window
    assert ledger.within(2.0, 1.0) == 0.0  # a window is half-open: (now - window, now]
    ledger.add(3.0, 0.25)
    assert ledger.within(3.0, 10.0) == pytest.approx(0.25)  # dropped entries stay dropped


def test_streams_p_served_alone_teach_p_s_step_not_d_s() -> None:
    t = Timings()
    t.observe_stream(3.0, 10, on_prefill=True)
    assert (t.step_s, t.prefill_step_s) == (None, pytest.approx(0.3))
    t.observe_stream(0.2, 10)
    assert (t.step_s, t.prefill_step_s) == (pytest.approx(0.02), pytest.approx(0.3))


def test_timings_ignore_observations_without_tokens() -> None:
    t = Timings()
    t.observe_prefill(1.0, 0)
    t.observe_stream(1.0, 0)
    assert (t.prefill_s_per_token, t.step_s) == (None, None)


# -- inputs read from a pool ----------------------------------------------------------------


def _pool(load: Callable[[Instance], int] | None = None) -> Any:
    cfg = parse_config(
        {
            "models": [
                {
                    "name": "tiny",
                    "mode": "pull",
                    "adaptive": {"enabled": True},
                    "prefill": [{"url": "http://p0:1"}, {"url": "http://p1:1"}],
                    "decode": [{"url": "http://d0:1", "slots": 2}],
                }
            ]
        }
    )
    pool = Registry(cfg, load=load).get("tiny")
    assert pool is not None
    return pool


def test_inputs_read_the_least_loaded_engines_and_the_pool_s_timings() -> None:
    pool = _pool()
    p0, p1 = pool.prefill
    (d,) = pool.decode
    pool.timings.observe_prefill(1.0, 500)
    pool.timings.observe_stream(0.5, 10)
    pool.timings.given_prefill.add(0.0, 1.0)  # over two P: 0.5 each
    pool.timings.given_decode.add(0.0, 0.25)
    d.take_slot()
    d.take_slot()
    with contextlib.ExitStack() as held:
        held.enter_context(d.computing_prompt(True))  # one of D's two is a prompt of its own
        held.enter_context(p0.running_leg())
        p1.stream_started()  # p1 serves one stream alone
        x = inputs(CFG, pool, 300, 1.0)
        assert x == Inputs(300, 0.002, 0.05, EngineLoad(1, 0), None, 0.5, 0.25)  # D: no slot
        d.give_slot()
        assert inputs(CFG, pool, 300, 1.0).decode == EngineLoad(streams=0, pending=1)
        p1.stream_ended()
    x = inputs(CFG, pool, 300, life_s(CFG))  # the given prompts are a life old
    assert (x.prefill, x.prefill_given, x.decode_given) == (IDLE, 0.0, 0.0)
    assert p1.load == 0 and p0.load == 0


def test_each_decision_gives_its_prompt_to_the_role_that_computes_it() -> None:
    """Without timings nothing is given (the cost is unknown); then P/D and P alone give the
    prompt's cost to P, D alone to D, for one life."""
    pool = _pool()
    assert decide(CFG, pool, 300, 0.0) is RouteChoice.PD
    assert pool.timings.given_prefill.within(0.0, 10.0) == 0.0
    pool.timings.observe_prefill(1.0, 1000)
    pool.timings.observe_stream(0.2, 10)
    assert decide(CFG, pool, 500, 1.0) is RouteChoice.DECODE_ALONE  # both idle: a tie goes to D
    assert inputs(CFG, pool, 500, 1.0).decode_given == pytest.approx(0.5)
    p0, p1 = pool.prefill
    with p0.running_leg(), p1.running_leg():  # every P computes a prompt of 0.1 s: keeps up
        assert decide(CFG, pool, 100, 2.0) is RouteChoice.PD
    assert inputs(CFG, pool, 500, 2.0).prefill_given == pytest.approx(0.1 / 2)
    later = inputs(CFG, pool, 500, 2.0 + life_s(CFG))
    assert (later.prefill_given, later.decode_given) == (0.0, 0.0)


def test_other_replicas_requests_reported_by_the_engines_count_as_load() -> None:
    """With several replicas, an engine's reported load beyond this router's own is the
    others': prompts pending on P (so P/D), streams on D."""
    pool = _pool(load=lambda inst: inst.load + 2)
    x = inputs(CFG, pool, 300, 0.0)
    assert (x.prefill, x.decode) == (EngineLoad(0, 2), EngineLoad(2, 0))
    # P has two others' prompts (3 x 0.4 s: behind): D would serve, but with its two others'
    # streams at 35 ms a step its budget is 0.24 s, under the prompt's 0.4 s, so P/D;
    # without them D would.
    assert choose(CFG, Inputs(200, 0.002, 0.035, x.prefill, x.decode)) is RouteChoice.PD
    assert choose(CFG, Inputs(200, 0.002, 0.035, x.prefill, IDLE)) is RouteChoice.DECODE_ALONE
