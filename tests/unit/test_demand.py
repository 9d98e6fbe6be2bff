"""Each role's demand in engines (router/demand.py): the numbers an autoscaler scales P and
D on, from the prompt tokens sent to P, the measured prefill and step times, and this
router's share of each D's streams; and their gauges on /metrics."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from router.config import parse_config
from router.demand import Demand, demands
from router.engines.instance import Instance, Role
from router.engines.timings import RateWindow
from router.metrics import Metrics
from router.registry import Registry


def _pool(
    autoscaling: dict[str, Any] | None = None, load: Callable[[Instance], int] | None = None
) -> Any:
    model = {
        "name": "tiny",
        "mode": "pull",
        "prefill": [{"url": "http://p0:1"}, {"url": "http://p1:1"}],
        "decode": [{"url": "http://d0:1", "slots": 8}, {"url": "http://d1:1", "slots": 8}],
        "autoscaling": autoscaling or {},
    }
    pool = Registry(parse_config({"models": [model]}), load=load).get("tiny")
    assert pool is not None
    return pool


def test_a_rate_window_counts_the_whole_seconds_of_the_last_minute() -> None:
    w = RateWindow(60)
    for second in range(100):
        w.add(second + 0.5, 10.0)
    assert w.rate(100.2) == pytest.approx(10.0)  # seconds 40..99, 10 a second
    assert w.rate(130.0) == pytest.approx(5.0)  # seconds 70..129: 30 of them counted
    assert w.rate(500.0) == 0.0


def test_p_is_busy_by_tokens_a_second_times_seconds_a_token_over_the_headroom() -> None:
    pool = _pool({"prefill_utilization": 0.5})
    assert demands(pool, 100.0)[0] == Demand(Role.PREFILL, 2, 0.0)  # nothing sent
    for second in range(40, 100):
        pool.timings.prefill_tokens.add(second, 3000)  # 3,000 tokens a second
    assert demands(pool, 100.0)[0].desired is None  # no prompt timed yet
    pool.timings.observe_prefill(0.5, 1000)  # 0.5 ms a token: 1.5 engines busy
    assert demands(pool, 100.0)[0].desired == pytest.approx(1.5 / 0.5)


def test_d_needs_its_streams_share_times_step_over_the_tpot_target() -> None:
    reported = {"http://d0:1": 6, "http://d1:1": 2}  # what each engine runs, all routers
    pool = _pool({"tpot_ms": 20}, load=lambda d: reported.get(d.url, d.in_use))
    d0, d1 = pool.decode
    assert demands(pool, 0.0)[1] == Demand(Role.DECODE, 2, 0.0)  # no streams
    for _ in range(3):
        d0.take_slot()  # half of d0's six streams are this router's
    d1.take_slot()
    d1.take_slot()  # all of d1's
    assert demands(pool, 0.0)[1].desired is None  # no step timed yet
    pool.timings.observe_stream(0.3, 10)  # 30 ms a token: 1.5x the 20 ms target
    assert demands(pool, 0.0)[1].desired == pytest.approx((0.5 + 1.0) * 1.5)


def test_without_a_tpot_target_ds_demand_is_unknown() -> None:
    pool = _pool()
    pool.decode[0].take_slot()
    pool.timings.observe_stream(0.3, 10)
    assert demands(pool, 0.0)[1].desired is None


def test_the_gauges_on_metrics_nan_until_measured() -> None:
    pool = _pool({"tpot_ms": 20})
    metrics = Metrics()
    metrics.attach_state(lambda: [pool], clock=lambda: 100.0)
    pool.decode[0].take_slot()
    text = metrics.render().decode()
    assert 'pdrouter_autoscale_engines{model="tiny",role="prefill"} 2.0' in text
    assert 'pdrouter_autoscale_desired_engines{model="tiny",role="prefill"} 0.0' in text
    decode = 'pdrouter_autoscale_desired_engines{model="tiny",role="decode"} '
    value = text.split(decode)[1].split("\n")[0]
    assert math.isnan(float(value))
    pool.timings.observe_stream(0.4, 10)
    assert decode + "2.0" in metrics.render().decode()
