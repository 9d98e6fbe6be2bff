"""A fleet of fake engines reporting different vLLM versions and block sizes, behind a router
whose health checks read them (``/version``, ``/metrics``): no request ever goes to a pair the
engines' handshakes would refuse, and where no pair is left the router says why (``/ready``,
the 503, the metrics)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from router.app import AppContext
from tests.conftest import Cluster, eventually, metric

pytestmark = pytest.mark.timeout(60)

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
IDENTITY = {"engine_id": "fake-prefill", "kv_host": "127.0.0.1", "kv_port": 5600}


def _set(cluster: Cluster, facts: dict[str, tuple[str, int]]) -> None:
    """Each engine's version and block size, by its name (p0, d1, ...)."""
    for engine in cluster.engines:
        engine.behaviour.version, engine.behaviour.block_size = facts[engine.name]


async def _facts_read(ctx: AppContext) -> None:
    await eventually(lambda: all(i.facts.version for i in ctx.registry.instances()))


def _pairs(cluster: Cluster) -> list[tuple[str, str]]:
    """(P, D) of every generate request, by the request id both legs carry."""
    decode = {r.request_id: e.name for e in cluster.decode for r in e.received}
    return [(e.name, decode[r.request_id]) for e in cluster.prefill for r in e.received]


async def test_a_mixed_fleet_pairs_only_engines_of_one_version(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    # A rolling upgrade half done: p0 and d0 on 0.33, p1 and d1 on 0.34.
    _set(cluster2, {"p0": ("0.33.0", 16), "d0": ("0.33.0", 16),
                    "p1": ("0.34.0", 64), "d1": ("0.34.0", 64)})  # fmt: skip
    url, ctx = await cluster2.router("pull", health_checks=True)
    await _facts_read(ctx)
    answers = await asyncio.gather(
        *(client.post(f"{url}/v1/completions", json=BODY) for _ in range(16))
    )
    assert [a.status_code for a in answers] == [200] * 16
    pairs = _pairs(cluster2)
    assert len(pairs) == 16 and set(pairs) == {("p0", "d0"), ("p1", "d1")}, pairs
    ready = (await client.get(f"{url}/ready?detail=1")).json()
    seen = {(i["url"], i["vllm_version"], i["block_size"], i["unpaired"])
            for i in ready["models"]["tiny"]["instances"]}  # fmt: skip
    urls = dict(zip(("p0", "p1"), cluster2.prefill_urls, strict=True))
    urls |= dict(zip(("d0", "d1"), cluster2.decode_urls, strict=True))
    assert seen == {(urls["p0"], "0.33.0", 16, None), (urls["d0"], "0.33.0", 16, None),
                    (urls["p1"], "0.34.0", 64, None), (urls["d1"], "0.34.0", 64, None)}  # fmt: skip
    labels = {"model": "tiny", "role": "decode", "engine": urls["d1"]}
    assert metric(ctx, "pdrouter_engine_info", vllm_version="0.34.0", block_size="64", **labels)
    assert metric(ctx, "pdrouter_engine_unpaired", **labels) == 0


async def test_a_push_d_of_another_block_size_waits_out_of_rotation_until_it_matches(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    _set(cluster2, {"p0": ("0.34.0", 64), "p1": ("0.34.0", 64),
                    "d0": ("0.34.0", 64), "d1": ("0.34.0", 16)})  # fmt: skip
    url, ctx = await cluster2.router("push", health_checks=True, prefill_extra=IDENTITY)
    await _facts_read(ctx)
    d1 = next(d for d in ctx.registry.instances() if d.url == cluster2.decode_urls[1])
    assert d1.unpaired == (
        "block size 64 on P and 16 on D: the connector's handshake refuses unequal block sizes"
    )
    for _ in range(6):
        answer = await client.post(f"{url}/v1/completions", json=BODY)
        assert answer.status_code == 200, answer.text
    assert cluster2.decode[1].received == [], "a D no P can write into got a request"
    assert metric(ctx, "pdrouter_engine_unpaired", engine=d1.url) == 1
    # Restarted with --block-size 64: read again within REREAD_EVERY checks, back in rotation.
    cluster2.decode[1].behaviour.block_size = 64
    await eventually(lambda: d1.unpaired is None and d1.routable)
    await asyncio.gather(*(client.post(f"{url}/v1/completions", json=BODY) for _ in range(8)))
    assert cluster2.decode[1].received, "back in rotation but never chosen"


async def test_no_pair_left_answers_503_with_why_and_calls_no_engine(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    _set(cluster, {"p0": ("0.33.0", 16), "d0": ("0.34.0", 16)})
    url, ctx = await cluster.router("pull", health_checks=True)
    await _facts_read(ctx)
    answer = await client.post(f"{url}/v1/completions", json=BODY)
    assert answer.status_code == 503
    error: dict[str, Any] = answer.json()["error"]
    assert error["code"] == "no_compatible_pair"
    assert "vLLM 0.33.0 on P and 0.34.0 on D" in error["message"]
    assert answer.headers.get("retry-after")
    assert all(e.received == [] for e in cluster.engines)
    ready = await client.get(f"{url}/ready?detail=1")
    assert ready.status_code == 503
    reasons = {i["unpaired"] for i in ready.json()["models"]["tiny"]["instances"]}
    assert len(reasons) == 1 and "NIXL's handshake refuses" in str(reasons.pop())
