"""Credentials and headers: what reaches the engines, and what never does."""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.conftest import Cluster

PROMPT = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


async def test_upstream_key_replaces_client_credentials(
    cluster: Cluster, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    url, ctx = await cluster.router(
        "pull", auth={"api_keys": ["client-key"], "upstream_api_key": "engine-secret"}
    )
    headers = {
        "authorization": "Bearer client-key",
        "proxy-authorization": "Basic abc",
        "cookie": "session=1",
        "x-forwarded-for": "10.1.2.3",
        "te": "trailers",
        "upgrade": "h2c",
    }
    caplog.set_level(logging.DEBUG)
    r = await client.post(url + "/v1/completions", json=PROMPT, headers=headers)
    assert r.status_code == 200
    for engine in cluster.engines:
        (req,) = engine.received
        assert req.headers["authorization"] == "Bearer engine-secret"
        for name in ("proxy-authorization", "cookie", "x-forwarded-for", "te", "upgrade"):
            assert name not in req.headers
    # A failure path logs, but never the key.
    cluster.prefill[0].behaviour.status = 500
    await client.post(url + "/v1/completions", json=PROMPT, headers=headers)
    assert "engine-secret" not in caplog.text
    assert "engine-secret" not in repr(ctx.config)
    assert "engine-secret" not in (await client.get(url + "/ready")).text


async def test_requests_cannot_choose_where_the_router_connects(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """No SSRF: URLs come from the config only, whatever a request names."""
    url, _ = await cluster.router("pull")
    tricks = [
        {**PROMPT, "model": "http://127.0.0.1:1/"},
        {**PROMPT, "kv_transfer_params": {"remote_host": "127.0.0.1", "remote_port": 1}},
        {**PROMPT, "base_url": "http://127.0.0.1:1"},
    ]
    for body in tricks:
        r = await client.post(url + "/v1/completions", json=body, headers={"host": "127.0.0.1:1"})
        assert r.status_code in (200, 404)
    urls = {*cluster.prefill_urls, *cluster.decode_urls}
    seen = {f"http://{req.headers['host']}" for e in cluster.engines for req in e.received}
    assert seen <= urls
