"""Session affinity (router/engines/affinity.py) over real sockets: a conversation's turns go
to the same P and D, by header, body field or (opt-in) prompt prefix, within the load bound;
an unhealthy affine engine is left for another; the session table stays bounded; the
session body field never reaches an engine."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from router.app import AppContext, create_app
from router.config import parse_config
from tests.conftest import Cluster, eventually, metric
from tests.fakes.fake_vllm import FakeEngine
from tests.fakes.servers import serve


def _chat(conv: str, turn: int) -> dict[str, Any]:
    history = [{"role": "user", "content": f"{conv} opening question"}]
    for t in range(turn):
        history += [
            {"role": "assistant", "content": f"answer {t}"},
            {"role": "user", "content": f"{conv} follow-up {t}"},
        ]
    return {"model": "tiny", "messages": history, "max_tokens": 4}


def _engines_of(engines: list[FakeEngine], conv: str) -> set[str]:
    """Names of the engines that received a request of conversation ``conv``."""
    return {e.name for e in engines for r in e.received if conv in str(r.body)}


async def _turns(
    client: httpx.AsyncClient, url: str, conv: str, turns: int, **how: Any
) -> list[int]:
    statuses = []
    for turn in range(turns):
        body = {**_chat(conv, turn), **how.get("body", {})}
        r = await client.post(f"{url}/v1/chat/completions", json=body, headers=how.get("headers"))
        statuses.append(r.status_code)
    return statuses


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize(
    "how",
    [
        {"headers": {"x-session-id": "S"}},
        {"headers": {"session-id": "S"}},
        {"headers": {"x-conversation-id": "S"}},
        {"body": {"session_id": "S"}},
    ],
    ids=["x-session-id", "session-id", "x-conversation-id", "body"],
)
async def test_every_turn_of_a_session_goes_to_the_same_p_and_d(
    cluster2: Cluster, client: httpx.AsyncClient, mode: str, how: dict[str, Any]
) -> None:
    url, ctx = await cluster2.router(mode)
    for i in range(6):
        conv = f"conv{i}"
        per_conv = {k: {n: v.replace("S", conv) for n, v in d.items()} for k, d in how.items()}
        assert await _turns(client, url, conv, 4, **per_conv) == [200] * 4
        assert len(_engines_of(cluster2.prefill, conv)) == 1, conv
        assert len(_engines_of(cluster2.decode, conv)) == 1, conv
    # Every turn after the first found its engines where the session went last time.
    assert metric(ctx, "pdrouter_session_routes_total", result="hit") == 2 * 6 * 3
    assert metric(ctx, "pdrouter_sessions") == 6
    for engine in cluster2.engines:
        assert all("session_id" not in r.body for r in engine.received)


async def test_without_a_session_requests_follow_the_policy(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    """Control: the same conversation without an id spreads (least loaded, rotating)."""
    url, ctx = await cluster2.router("push")
    assert await _turns(client, url, "conv", 4) == [200] * 4
    assert len(_engines_of(cluster2.decode, "conv")) == 2
    assert metric(ctx, "pdrouter_sessions") == 0


async def test_prefix_fallback_keeps_a_conversation_together_without_an_id(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await cluster2.router("push", model={"sessions": {"prefix_fallback": True}})
    for conv in ("alpha", "beta", "gamma"):
        assert await _turns(client, url, conv, 4) == [200] * 4
        assert len(_engines_of(cluster2.prefill, conv)) == 1, conv
        assert len(_engines_of(cluster2.decode, conv)) == 1, conv


async def test_one_busy_session_spills_only_when_its_engine_nears_its_slots(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    """Eight concurrent requests of one session on two decode engines of 8 slots: the affine
    one takes them while it holds at most floor(0.9 x 8) = 7, the other one only the 8th."""
    gate = asyncio.Event()  # D answers nothing until every request holds its slot
    for d in cluster2.decode:
        d.behaviour.gate = gate
    url, ctx = await cluster2.router("push", decode_extra={"slots": 8})
    body = {**_chat("busy", 0), "stream": True}
    headers = {"x-session-id": "busy"}
    sent = [
        asyncio.create_task(client.post(f"{url}/v1/chat/completions", json=body, headers=headers))
        for _ in range(8)
    ]
    await eventually(lambda: sum(d.active for d in cluster2.decode) == 8)
    peaks = sorted(d.peak for d in cluster2.decode)
    gate.set()
    assert [r.status_code for r in await asyncio.gather(*sent)] == [200] * 8
    assert peaks == [1, 7], peaks
    assert metric(ctx, "pdrouter_session_routes_total", role="decode", result="spilled") == 1


async def test_an_unhealthy_affine_engine_is_left_for_another(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await cluster2.router("push", health_checks=True)
    headers = {"x-session-id": "moving"}
    first = await client.post(
        f"{url}/v1/chat/completions", json=_chat("moving", 0), headers=headers
    )
    assert first.status_code == 200
    [d_name] = _engines_of(cluster2.decode, "moving")
    affine = next(d for d in cluster2.decode if d.name == d_name)
    affine.behaviour.health_status = 503
    await eventually(lambda: not _instance(ctx, affine, cluster2).in_rotation, timeout=5)
    assert await _turns(client, url, "moving", 3, headers=headers) == [200] * 3
    assert len(_engines_of(cluster2.decode, "moving")) == 2
    # The session now stays where it was moved to.
    moved = [d for d in cluster2.decode if d is not affine]
    assert sum(1 for r in moved[0].received if "moving" in str(r.body)) == 3
    affine.behaviour.health_status = 200


def _instance(ctx: AppContext, engine: FakeEngine, cluster: Cluster) -> Any:
    url = cluster.decode_urls[cluster.decode.index(engine)]
    return next(i for i in ctx.registry.instances() if i.url == url)


async def test_session_table_is_bounded_in_size_and_time(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    skew = [0.0]  # the router's clock runs with time, and jumps when the test says
    model = {"sessions": {"max_sessions": 3, "ttl_seconds": 60}}
    app = create_app(
        parse_config(cluster.config("pull", model=model)),
        health_checks=False,
        clock=lambda: time.monotonic() + skew[0],
    )
    url = await cluster.stack.enter_async_context(serve(app))
    ctx = app.state.ctx
    cluster.routers.append(ctx)
    for i in range(5):
        assert await _turns(client, url, f"c{i}", 1, headers={"x-session-id": f"c{i}"}) == [200]
    assert metric(ctx, "pdrouter_sessions") == 3
    skew[0] = 61.0  # longer than the TTL: every entry has expired
    assert await _turns(client, url, "late", 1, headers={"x-session-id": "late"}) == [200]
    assert metric(ctx, "pdrouter_sessions") == 1


async def test_affinity_off_still_strips_the_body_field(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await cluster.router("pull", model={"sessions": {"enabled": False}})
    body = {**_chat("off", 0), "session_id": "off"}
    assert (await client.post(f"{url}/v1/chat/completions", json=body)).status_code == 200
    assert all("session_id" not in r.body for e in cluster.engines for r in e.received)
    assert metric(ctx, "pdrouter_sessions") == 0
