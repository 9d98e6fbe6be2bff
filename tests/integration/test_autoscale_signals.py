"""The autoscaling gauges (``pdrouter_autoscale_desired_engines``, router/demand.py) under a load
the test drives through a router over fake engines on real sockets: prompts of known length
that P computes in a known time on the router's clock (the test holds P's answer and moves
the clock), and streams held open on D; the gauges read back off /metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from router.app import AppContext, create_app
from router.config import parse_config
from tests.conftest import Cluster, eventually, metric
from tests.fakes.clock import Clock
from tests.fakes.servers import serve

DESIRED = "pdrouter_autoscale_desired_engines"
ENGINES = "pdrouter_autoscale_engines"
PROMPT_TOKENS = 1200


async def _router(cluster: Cluster, clock: Clock) -> tuple[str, AppContext]:
    autoscaling = {"prefill_utilization": 0.5, "tpot_ms": 20}
    cfg = parse_config(cluster.config(model={"autoscaling": autoscaling}))
    app = create_app(cfg, clock=clock)
    url = await cluster.stack.enter_async_context(serve(app))
    ctx: AppContext = app.state.ctx
    cluster.routers.append(ctx)
    return url, ctx


def _body(max_tokens: int = 2) -> dict[str, Any]:
    # A prompt of token ids: the router counts its tokens exactly.
    return {"model": "tiny", "prompt": list(range(PROMPT_TOKENS)), "max_tokens": max_tokens}


async def _prompt_computed_in(
    cluster: Cluster, client: httpx.AsyncClient, url: str, clock: Clock, seconds: float
) -> None:
    """One request whose P leg takes ``seconds`` on the router's clock."""
    p = cluster.prefill[0]
    seen = len(p.received)
    p.behaviour.gate = gate = asyncio.Event()
    sent = asyncio.create_task(client.post(url + "/v1/completions", json=_body()))
    await eventually(lambda: len(p.received) > seen)
    clock.advance(seconds)
    gate.set()
    assert (await sent).status_code == 200
    p.behaviour.gate = None


async def test_the_gauges_give_the_engines_the_driven_load_needs(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    clock = Clock(1000.0)
    url, ctx = await _router(cluster, clock)

    def desired(role: str) -> float:
        return metric(ctx, DESIRED, model="tiny", role=role)

    assert desired("prefill") == desired("decode") == 0.0  # idle
    assert metric(ctx, ENGINES, model="tiny", role="decode") == 1
    # Three prompts of 1,200 tokens, each computed in 0.6 s (0.5 ms a token), in one minute.
    for _ in range(3):
        await _prompt_computed_in(cluster, client, url, clock, 0.6)
        clock.advance(1.0)
    # 3,600 tokens over the window's 60 s = 60 tokens/s x 0.5 ms = 0.03 P busy, / 0.5 headroom.
    assert desired("prefill") == pytest.approx(60 * 0.0005 / 0.5)

    # D: three streams held open on it (its answers held), at a step time of 30 ms a token
    # (as a stream would have taught it: the fake's steps are real time, not the clock's).
    pool = ctx.registry.get("tiny")
    assert pool is not None
    pool.timings.step_s = None  # the answers above came in one read each: no step timed
    pool.timings.observe_stream(0.3, 10)
    d = cluster.decode[0]
    seen = len(d.received)
    d.behaviour.gate = held = asyncio.Event()
    streams = [
        asyncio.create_task(client.post(url + "/v1/completions", json=_body(4))) for _ in range(3)
    ]
    await eventually(lambda: len(d.received) == seen + 3)
    # D steps its 3 streams in 30 ms; at the 20 ms target (step time taken as proportional
    # to the streams) it holds 2: 3 streams need 1.5 engines.
    assert desired("decode") == pytest.approx(3 / (3 * 0.020 / 0.030))
    held.set()
    assert [(await s).status_code for s in streams] == [200] * 3
    d.behaviour.gate = None
    assert desired("decode") == 0.0  # the streams ended
    # A minute later nothing was sent: P's demand falls back to 0.
    clock.advance(61.0)
    assert desired("prefill") == 0.0
