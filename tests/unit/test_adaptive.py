"""The adaptive rule (router/pd/adaptive.py): each branch on inputs given by the test, the
inputs read from a model's pool, and the timings it learns from (router/engines/timings.py).

Defaults of the rule here: TTFT 1,500 ms, TPOT 40 ms, a stall spread over 64 tokens; a
1,000-token prompt at 1 ms a token costs 1 s on one engine, which adds 15.6 ms to the TPOT of
a stream it stalls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from router.config import AdaptiveConfig, parse_config
from router.engines.instance import Instance
from router.engines.timings import BUSY_WEIGHT, WEIGHT, Timings
from router.metrics import ROUTE_CHOICES
from router.pd.adaptive import Choice, EngineLoad, Inputs, choose, decide, inputs
from router.registry import Registry

CFG = AdaptiveConfig(enabled=True)
IDLE = EngineLoad(streams=0, pending=0)
MS = 0.001


def _inputs(
    prefill: EngineLoad | None = IDLE,
    decode: EngineLoad | None = IDLE,
    *,
    tokens: int = 1000,
    per_token: float | None = 1 * MS,
    step: float | None = 20 * MS,
) -> Inputs:
    return Inputs(tokens, per_token, step, prefill, decode)


def _cfg(**kw: Any) -> AdaptiveConfig:
    return AdaptiveConfig(enabled=True, **kw)


def test_both_engines_idle_one_engine_serves_and_a_tie_goes_to_d() -> None:
    assert choose(CFG, _inputs()) is Choice.DECODE_ALONE


def test_without_timings_the_static_mode_serves_and_teaches_them() -> None:
    assert choose(CFG, _inputs(per_token=None)) is Choice.PD
    assert choose(CFG, _inputs(step=None)) is Choice.PD


def test_with_a_prompt_pending_on_p_the_shorter_queue_serves_within_d_s_tpot() -> None:
    """P computes a prompt: D computes this one alone if it has fewer pending and its streams
    keep their TPOT, else the request queues at P (P/D)."""
    busy_p = EngineLoad(streams=0, pending=1)
    assert choose(CFG, _inputs(prefill=busy_p)) is Choice.DECODE_ALONE
    d_streams = EngineLoad(streams=3, pending=0)  # 30 ms + 15.6 ms of stall > 40 ms
    assert choose(CFG, _inputs(busy_p, d_streams, step=30 * MS)) is Choice.PD
    assert choose(CFG, _inputs(busy_p, d_streams, step=20 * MS)) is Choice.DECODE_ALONE
    d_prompt = EngineLoad(streams=0, pending=1)  # as many queued on D as on P
    assert choose(CFG, _inputs(busy_p, d_prompt, tokens=500)) is Choice.PD
    assert choose(_cfg(single_engine="prefill"), _inputs(prefill=busy_p)) is Choice.PD


def test_no_routable_p_leaves_the_request_to_the_static_mode() -> None:
    assert choose(CFG, _inputs(prefill=None)) is Choice.PD


def test_the_less_loaded_engine_serves_alone() -> None:
    d_decodes = EngineLoad(streams=1, pending=0)
    assert choose(CFG, _inputs(decode=d_decodes)) is Choice.PREFILL_ALONE
    p_decodes = EngineLoad(streams=1, pending=0)
    assert choose(CFG, _inputs(prefill=p_decodes)) is Choice.DECODE_ALONE


def test_a_prefill_that_would_break_the_tpot_of_d_s_streams_goes_p_d() -> None:
    """Exactly at the budget D still serves alone; a millisecond of step more, P/D."""
    streams = EngineLoad(streams=3, pending=0)
    only_d = _cfg(single_engine="decode", stall_tokens=50)  # 1 s / 50 = 20 ms a token
    assert choose(only_d, _inputs(decode=streams, step=20 * MS)) is Choice.DECODE_ALONE
    assert choose(only_d, _inputs(decode=streams, step=21 * MS)) is Choice.PD


def test_an_idle_engine_has_no_tpot_to_keep() -> None:
    """A step time far over TPOT does not matter to an engine that decodes nothing."""
    assert choose(CFG, _inputs(step=500 * MS)) is Choice.DECODE_ALONE


def test_a_prompt_over_the_ttft_on_one_engine_goes_p_d() -> None:
    assert choose(CFG, _inputs(tokens=1500)) is Choice.DECODE_ALONE  # 1.5 s: at the target
    assert choose(CFG, _inputs(tokens=1501)) is Choice.PD


def test_prompts_pending_on_d_count_in_this_one_s_ttft() -> None:
    """D has one prompt of its own to compute: this one would start after it (2 x 1 s over
    a 1.5 s TTFT), so the idle P serves it."""
    d_prefills = EngineLoad(streams=0, pending=1)
    assert choose(CFG, _inputs(decode=d_prefills)) is Choice.PREFILL_ALONE
    assert choose(_cfg(single_engine="decode"), _inputs(decode=d_prefills)) is Choice.PD


def test_single_engine_limits_which_engine_may_serve_alone() -> None:
    assert choose(_cfg(single_engine="prefill"), _inputs()) is Choice.PREFILL_ALONE
    d_decodes = EngineLoad(streams=1, pending=0)
    assert choose(_cfg(single_engine="decode"), _inputs(decode=d_decodes)) is Choice.DECODE_ALONE


def test_no_free_decode_slot_leaves_p_alone_or_p_d() -> None:
    assert choose(CFG, _inputs(decode=None)) is Choice.PREFILL_ALONE
    assert choose(_cfg(single_engine="decode"), _inputs(decode=None)) is Choice.PD


def test_low_load_goes_to_one_engine_and_high_load_to_p_d() -> None:
    """The rule's direction: the same prompt and timings, one engine at idle, P/D once both
    engines decode streams a local prefill would stall past the TPOT target."""
    slow_step = 30 * MS  # + 15.6 ms of stall: over 40 ms
    assert choose(CFG, _inputs(step=slow_step)) is not Choice.PD
    loaded = EngineLoad(streams=4, pending=0)
    assert choose(CFG, _inputs(loaded, loaded, step=slow_step)) is Choice.PD


def test_an_engine_busy_with_prompts_would_stall_a_stream_served_there_alone() -> None:
    """P idle at this instant but on P/D prompts 80% of the time: a stream it served alone
    would wait behind them (20 ms / 0.2 = 100 ms a token), so D, less idle but with a TPOT to
    spare (20 + 15.6 ms), serves it; a share of 10% (22 ms) leaves it to P."""
    d_decodes = EngineLoad(streams=1, pending=0)
    assert choose(CFG, _inputs(decode=d_decodes)) is Choice.PREFILL_ALONE
    x = Inputs(1000, 1 * MS, 20 * MS, IDLE, d_decodes, prefill_busy=0.8)
    assert choose(CFG, x) is Choice.DECODE_ALONE
    x = Inputs(1000, 1 * MS, 20 * MS, IDLE, d_decodes, prefill_busy=0.1)
    assert choose(CFG, x) is Choice.PREFILL_ALONE
    both_busy = Inputs(1000, 1 * MS, 20 * MS, IDLE, d_decodes, prefill_busy=0.8, decode_busy=0.8)
    assert choose(CFG, both_busy) is Choice.PD


def test_the_counter_s_labels_are_the_rule_s_choices() -> None:
    assert set(ROUTE_CHOICES) == {c.value for c in Choice}


# -- timings ---------------------------------------------------------------------------


def test_timings_start_unknown_then_follow_recent_observations() -> None:
    t = Timings()
    assert (t.prefill_s_per_token, t.step_s) == (None, None)
    t.observe_prefill(2.0, 1000)
    t.observe_stream(1.0, 50)
    assert (t.prefill_s_per_token, t.step_s) == (pytest.approx(0.002), pytest.approx(0.02))
    t.observe_prefill(4.0, 1000)
    assert t.prefill_s_per_token == pytest.approx(0.002 + WEIGHT * 0.002)


def test_busy_shares_are_the_share_of_recent_arrivals_that_found_a_prompt_pending() -> None:
    t = Timings()
    assert (t.prefill_busy, t.decode_busy) == (0.0, 0.0)
    t.observe_arrival(prefill_busy=True, decode_busy=False)
    assert (t.prefill_busy, t.decode_busy) == (pytest.approx(BUSY_WEIGHT), 0.0)
    for _ in range(100):
        t.observe_arrival(prefill_busy=True, decode_busy=True)
    assert t.prefill_busy == pytest.approx(1.0, abs=1e-3) and t.decode_busy > 0.99


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
    d.take_slot()
    d.take_slot()
    with contextlib.ExitStack() as held:
        held.enter_context(d.computing_prompt(True))  # one of D's two is a prompt of its own
        held.enter_context(p0.running_leg())
        p1.stream_started()  # p1 serves one stream alone
        x = inputs(pool, 300)
        assert x == Inputs(300, 0.002, 0.05, EngineLoad(1, 0), None)  # D has no free slot
        d.give_slot()
        assert inputs(pool, 300).decode == EngineLoad(streams=0, pending=1)
        p1.stream_ended()
    assert inputs(pool, 300).prefill == IDLE
    assert p1.load == 0 and p0.load == 0


def test_each_decision_records_what_its_arrival_found() -> None:
    pool = _pool()
    p0, p1 = pool.prefill
    with p0.running_leg(), p1.running_leg():  # every P computes a prompt: P is busy
        assert decide(CFG, pool, 300) is Choice.PD  # no timings yet
    assert (pool.timings.prefill_busy, pool.timings.decode_busy) == (BUSY_WEIGHT, 0.0)
    assert inputs(pool, 300).prefill_busy == BUSY_WEIGHT


def test_other_replicas_requests_reported_by_the_engines_count_as_load() -> None:
    """With several replicas, an engine's reported load beyond this router's own is the
    others': prompts pending on P (so P/D), streams on D."""
    pool = _pool(load=lambda inst: inst.load + 2)
    x = inputs(pool, 300)
    assert (x.prefill, x.decode) == (EngineLoad(0, 2), EngineLoad(2, 0))
    # P has two others' prompts: D would serve, but its two others' streams (35 ms a step)
    # cannot take a 0.4 s stall (+6.25 ms) within 40 ms, so P/D; without them D would.
    assert choose(CFG, Inputs(200, 0.002, 0.035, x.prefill, x.decode)) is Choice.PD
    assert choose(CFG, Inputs(200, 0.002, 0.035, x.prefill, IDLE)) is Choice.DECODE_ALONE
