"""Per-key limits and the fair queue over real sockets. Timing is the test's: the fake D
answers a request only when the test gives it a turn, so who waits behind whom is decided
here, not by the scheduler (the time ratios are bench/abuse.py's)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.conftest import Cluster, eventually, metric

FLOOD, QUIET = "flood-key-0123", "quiet-key-4567"
KEYS = {
    "keys": [
        {"name": "flood", "key": FLOOD, "limits": {"max_concurrent": 8}},
        {"name": "quiet", "key": QUIET},
    ]
}


def _body(tag: str) -> dict[str, Any]:
    return {"model": "tiny", "prompt": tag, "max_tokens": 2}


def _as(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def _router(cluster: Cluster, slots: int, **overrides: Any) -> tuple[str, Any]:
    cluster.decode[0].behaviour.turns = asyncio.Semaphore(0)
    return await cluster.router("aggregated", auth=KEYS, decode_extra={"slots": slots}, **overrides)


def _served(cluster: Cluster) -> list[str]:
    """The prompts D received, in the order it received them."""
    return [str(r.body["prompt"]) for r in cluster.decode[0].received]


async def _give_turns(cluster: Cluster, n: int) -> None:
    """Let D answer ``n`` more requests, one at a time, each freed slot taken again."""
    turns = cluster.decode[0].behaviour.turns
    assert turns is not None
    for _ in range(n):
        seen = len(cluster.decode[0].received)
        turns.release()
        await eventually(lambda seen=seen: len(cluster.decode[0].received) > seen)


async def test_a_flood_waits_behind_itself_and_gets_the_429s(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """Ten times the quiet key's requests, all at once: the flood fills the slots and its
    own share of the queue and is refused beyond its limit; the quiet key's requests,
    arriving behind four of the flood's, are the next served, as if alone."""
    url, ctx = await _router(cluster, slots=4)
    pool = ctx.registry.get("tiny")
    flood = [
        asyncio.create_task(
            client.post(url + "/v1/completions", json=_body(f"flood-{i}"), headers=_as(FLOOD))
        )
        for i in range(20)
    ]
    await eventually(lambda: cluster.decode[0].active == 4 and pool.ledger.queue_depth == 4)
    await eventually(lambda: sum(t.done() for t in flood) == 12)
    quiet = [
        asyncio.create_task(
            client.post(url + "/v1/completions", json=_body(f"quiet-{i}"), headers=_as(QUIET))
        )
        for i in range(2)
    ]
    await eventually(lambda: pool.ledger.queue_depth == 6)
    await _give_turns(cluster, 2)  # two slots free up, one after the other
    assert _served(cluster)[4:6] == ["quiet-0", "quiet-1"]
    await _give_turns(cluster, 4)
    assert sorted(_served(cluster)[6:]) == sorted(f"flood-{i}" for i in range(4, 8))
    _release_all(cluster)
    answers = await asyncio.gather(*flood, *quiet)
    flood_answers, quiet_answers = answers[:20], answers[20:]
    assert [r.status_code for r in quiet_answers] == [200, 200]
    refused = [r for r in flood_answers if r.status_code == 429]
    assert len(refused) == 12 and sum(r.status_code == 200 for r in flood_answers) == 8
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert r.json()["error"]["code"] == "concurrency_limit_exceeded"
    assert metric(ctx, "pdrouter_key_requests_total", key="flood", result="admitted") == 8
    limited = metric(ctx, "pdrouter_key_requests_total", key="flood", result="concurrency_limited")
    assert limited == 12
    assert metric(ctx, "pdrouter_key_requests_total", key="quiet", result="admitted") == 2
    assert metric(ctx, "pdrouter_key_queue_wait_seconds_count", key="quiet") == 2
    await eventually(lambda: metric(ctx, "pdrouter_key_in_flight") == 0)


async def test_rate_limit_per_key(cluster: Cluster, client: httpx.AsyncClient) -> None:
    keys = {
        "keys": [
            {"name": "slow", "key": FLOOD, "limits": {"requests_per_second": 0.001, "burst": 2}},
            {"name": "quiet", "key": QUIET},
        ]
    }
    url, ctx = await cluster.router("aggregated", auth=keys)
    codes = [
        (await client.post(url + "/v1/completions", json=_body("x"), headers=_as(FLOOD)))
        for _ in range(3)
    ]
    assert [r.status_code for r in codes] == [200, 200, 429]
    refused = codes[-1]
    assert int(refused.headers["retry-after"]) >= 999  # a token every 1,000 s
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "'slow'" in refused.json()["error"]["message"] and FLOOD not in refused.text
    for _ in range(3):  # another key's budget is its own
        r = await client.post(url + "/v1/completions", json=_body("y"), headers=_as(QUIET))
        assert r.status_code == 200
    assert len(cluster.decode[0].received) == 5  # the refused request reached no engine
    assert metric(ctx, "pdrouter_key_requests_total", key="slow", result="rate_limited") == 1
    assert metric(ctx, "pdrouter_requests_total", outcome="rate_limited") == 1


async def test_a_full_queue_is_taken_from_the_key_holding_most_of_it(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await _router(cluster, slots=1, admission={"queue_size": 3})
    pool = ctx.registry.get("tiny")

    def send(key: str, tag: str) -> asyncio.Task[httpx.Response]:
        post = client.post(url + "/v1/completions", json=_body(tag), headers=_as(key))
        return asyncio.create_task(post)

    flood = [send(FLOOD, f"flood-{i}") for i in range(4)]  # one in the slot, three queued
    await eventually(lambda: pool.ledger.queue_depth == 3)
    quiet = send(QUIET, "quiet-0")
    await eventually(lambda: flood[3].done())  # the flood's newest gave up its place
    assert flood[3].result().status_code == 429
    assert flood[3].result().json()["error"]["code"] == "queue_share_exceeded"
    assert pool.ledger.queue_depth == 3
    await _give_turns(cluster, 2)  # one slot: the keys take turns, quiet's first
    assert _served(cluster) == ["flood-0", "quiet-0", "flood-1"]
    _release_all(cluster)
    assert (await quiet).status_code == 200
    assert [(await t).status_code for t in flood[:3]] == [200, 200, 200]
    share = metric(ctx, "pdrouter_key_requests_total", key="flood", result="queue_share_exceeded")
    assert share == 1


def _release_all(cluster: Cluster) -> None:
    """Every request from now on answered at once, those already waiting included."""
    turns = cluster.decode[0].behaviour.turns
    assert turns is not None
    for _ in range(100):
        turns.release()
