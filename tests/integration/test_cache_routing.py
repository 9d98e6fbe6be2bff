"""Cache-aware routing over fake engines that publish KV events (router/kvindex): requests
go to the P and the D that hold their prompt's start, with or without a session id; what the
router predicts is what the engine then finds; an engine whose events are unknown, or a
request whose token ids cannot be had, is routed as without events; the index follows the
registry and shows in /metrics."""

from __future__ import annotations

from typing import Any

import httpx

from router.app import AppContext, create_app
from router.config import parse_config
from tests.conftest import Cluster, eventually, metric
from tests.fakes.fake_vllm import FakeEngine
from tests.fakes.kv_cluster import events_config, synced, with_events
from tests.fakes.servers import serve

# Two long system prompts that differ from their first block on (the fake's blocks: 16 bytes).
SYSTEM = [f"{k}: You are an assistant. " + "Follow the house rules carefully. " * 20 for k in "012"]


def _chat(system: str, question: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "tiny", "messages": messages, "max_tokens": 4}


def _engines(cluster: Cluster) -> dict[str, FakeEngine]:
    urls = [*cluster.prefill_urls, *cluster.decode_urls]
    return dict(zip(urls, cluster.engines, strict=True))


async def _router(cluster: Cluster, mode: str = "pull", **overrides: Any) -> tuple[str, AppContext]:
    events = overrides.pop("events", {})
    cfg = events_config(cluster.config(mode, **overrides), _engines(cluster), **events)
    app = create_app(parse_config(cfg), health_checks=False)
    url = await cluster.stack.enter_async_context(serve(app))
    ctx: AppContext = app.state.ctx
    cluster.routers.append(ctx)
    return url, ctx


def _predicted(ctx: AppContext, role: str) -> float:
    return metric(ctx, "pdrouter_cache_predicted_tokens_sum", role=role)


async def _shared_prefix_run(
    cluster2: Cluster, client: httpx.AsyncClient, url: str, ctx: AppContext | None
) -> tuple[int, int]:
    """Twelve requests over three long system prompts: (P hits, D hits) from the 4th on."""
    hits = [0, 0]
    for i in range(12):
        if ctx is not None:
            await synced([ctx], cluster2.engines)
        before = {e.name: len(e.received) for e in cluster2.engines}
        r = await client.post(url + "/v1/chat/completions", json=_chat(SYSTEM[i % 3], f"q{i}?"))
        assert r.status_code == 200, r.text
        (p_rec,) = [
            rec
            for e in cluster2.prefill
            for rec in e.received[before[e.name] :]
            if rec.path != "/tokenize"
        ]
        (d_rec,) = [rec for e in cluster2.decode for rec in e.received[before[e.name] :]]
        if i >= 3:
            hits[0] += bool(p_rec.cached)
            hits[1] += bool(d_rec.cached)
    return hits[0], hits[1]


async def test_requests_sharing_a_long_prompt_go_to_the_engines_that_hold_it(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    """No session ids: every request after the first of its system prompt finds it cached on
    both its P and its D, and the router predicted exactly what P found."""
    await with_events(cluster2.engines, cluster2.stack)
    url, ctx = await _router(cluster2)
    predicted = []
    for i in range(6):
        await synced([ctx], cluster2.engines)
        before = _predicted(ctx, "prefill")
        r = await client.post(url + "/v1/chat/completions", json=_chat(SYSTEM[i % 2], f"q{i}?"))
        assert r.status_code == 200, r.text
        (p_rec,) = [
            e.received[-1]
            for e in cluster2.prefill
            if e.received
            and e.received[-1].path.endswith("/chat/completions")
            and e.received[-1].body["messages"][1]["content"] == f"q{i}?"
        ]
        predicted.append((_predicted(ctx, "prefill") - before, p_rec.cached))
    assert all(guess == found for guess, found in predicted), predicted
    assert all(found and found >= 16 * 20 for _, found in predicted[2:]), predicted
    assert metric(ctx, "pdrouter_cache_routes_total", role="decode", result="cached") == 4
    assert metric(ctx, "pdrouter_cache_routes_total", role="prefill", result="cached") == 4
    # Token ids came from P's /tokenize, once per request.
    assert sum(r.path == "/tokenize" for e in cluster2.prefill for r in e.received) == 6


async def test_without_events_the_same_requests_miss_the_cache_more(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    """Positive control: the engines cache alike, but the router spreads by load alone."""
    await with_events(cluster2.engines, cluster2.stack)
    url, _ = await cluster2.router("pull")
    p_hits, d_hits = await _shared_prefix_run(cluster2, client, url, None)
    assert p_hits + d_hits < 2 * 9, (p_hits, d_hits)
    url, ctx = await _router(cluster2)  # the same engines, now with events: all hit
    assert await _shared_prefix_run(cluster2, client, url, ctx) == (9, 9)


async def test_an_engine_whose_events_are_unknown_is_routed_as_without_events(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    """One D publishes nothing the router can reach: unknown is not empty, so D is chosen by
    the usual rule (here least loaded, rotating) while P is still chosen by its cache."""
    await with_events([*cluster2.prefill, cluster2.decode[0]], cluster2.stack)
    url, ctx = await _router(cluster2, events={"replay_timeout": 0.2})
    for i in range(4):
        await synced([ctx], [*cluster2.prefill, cluster2.decode[0]])
        r = await client.post(url + "/v1/chat/completions", json=_chat(SYSTEM[0], f"q{i}?"))
        assert r.status_code == 200
    assert metric(ctx, "pdrouter_cache_routes_total", role="decode", result="unknown") == 4
    assert metric(ctx, "pdrouter_cache_routes_total", role="prefill", result="cached") == 3
    assert all(len(d.received) == 2 for d in cluster2.decode)  # spread as without events
    assert metric(ctx, "pdrouter_kv_index_engines", state="unknown") == 1
    assert metric(ctx, "pdrouter_kv_index_known", engine=cluster2.decode_urls[1]) == 0


async def test_a_request_whose_token_ids_cannot_be_had_is_routed_as_without_events(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    await with_events(cluster2.engines, cluster2.stack)
    for p in cluster2.prefill:
        p.behaviour.tokenize_status = 500
    url, ctx = await _router(cluster2)
    await synced([ctx], cluster2.engines)
    r = await client.post(url + "/v1/chat/completions", json=_chat(SYSTEM[0], "q?"))
    assert r.status_code == 200
    assert metric(ctx, "pdrouter_cache_routes_total", result="no_tokens") == 2  # P and D
    # A prompt of token ids needs no /tokenize. "Cold" (known, nothing cached) needs both
    # engines' events read, the first request's included: until then an engine is "unknown".
    await synced([ctx], cluster2.engines)
    body = {"model": "tiny", "prompt": list(range(100)), "max_tokens": 2}
    r = await client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200
    assert metric(ctx, "pdrouter_cache_routes_total", result="cold") == 2


async def test_the_index_follows_the_registry_and_shows_in_metrics(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    await with_events(cluster2.engines, cluster2.stack)
    engines = _engines(cluster2)
    url, ctx = await _router(cluster2, events={"max_blocks_per_engine": 5000})
    await synced([ctx], cluster2.engines)
    assert metric(ctx, "pdrouter_kv_index_engines", state="known") == 4
    assert metric(ctx, "pdrouter_kv_index_max_blocks", engine=cluster2.decode_urls[0]) == 5000
    r = await client.post(url + "/v1/chat/completions", json=_chat(SYSTEM[0], "q?"))
    assert r.status_code == 200
    await synced([ctx], cluster2.engines)
    assert metric(ctx, "pdrouter_kv_index_blocks") > 0
    assert metric(ctx, "pdrouter_kv_index_events_total", kind="stored") > 0
    assert metric(ctx, "pdrouter_kv_index_gaps_total", result="unfilled") == 0

    # A reload that drops one D stops following it; one that brings it back starts over.
    smaller = cluster2.config("pull")
    smaller["models"][0]["decode"] = smaller["models"][0]["decode"][:1]
    ctx.registry.apply(parse_config(events_config(smaller, engines)))
    assert {s.url for s in ctx.kv_index.streams()} == {
        *cluster2.prefill_urls,
        cluster2.decode_urls[0],
    }
    ctx.registry.apply(parse_config(events_config(cluster2.config("pull"), engines)))
    await eventually(lambda: len(ctx.kv_index.streams()) == 4)
    await synced([ctx], cluster2.engines)
    assert metric(ctx, "pdrouter_kv_index_engines", state="known") == 4
