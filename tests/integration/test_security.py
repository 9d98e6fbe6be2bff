"""Credentials and headers: what reaches the engines, and what never does."""

from __future__ import annotations

import logging

import httpx
import pytest

from router.app import create_app
from tests.conftest import Cluster, metric

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
    r = await client.post(url + "/v1/completions", json=PROMPT, headers=headers)
    assert r.status_code == 502 and "event=attempt_failed" in caplog.text  # it did log
    assert "engine-secret" not in caplog.text
    assert "engine-secret" not in repr(ctx.config)
    assert "engine-secret" not in (await client.get(url + "/ready")).text


async def test_requests_cannot_choose_where_the_router_connects(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """No SSRF: URLs come from the config only, whatever a request names."""
    url, _ = await cluster.router("pull")
    tricks = [
        # A model named by URL is an unknown model, answered as vLLM answers one.
        ({**PROMPT, "model": "http://127.0.0.1:1/"}, 404),
        # Routing fields from the client are dropped; the request is served as usual.
        ({**PROMPT, "kv_transfer_params": {"remote_host": "127.0.0.1", "remote_port": 1}}, 200),
        ({**PROMPT, "base_url": "http://127.0.0.1:1"}, 200),
    ]
    for body, status in tricks:
        r = await client.post(url + "/v1/completions", json=body, headers={"host": "127.0.0.1:1"})
        assert r.status_code == status, (body, r.text)
    urls = {*cluster.prefill_urls, *cluster.decode_urls}
    seen = {f"http://{req.headers['host']}" for e in cluster.engines for req in e.received}
    assert seen == urls  # both served requests reached the configured engines, and only them
    d_legs = cluster.decode[0].received
    assert [leg.kv.get("remote_port") for leg in d_legs] == [5600, 5600]  # P's, not the client's


# -- one rule: a key on every route but the probes ---------------------------------------

KEY = "s3cret-key-for-tests"
WRONG = "not-the-key-at-all"
AUTH = {"keys": [{"name": "team-a", "key": KEY}]}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# Every route the router serves (and one it does not), what it gets, and its answer with
# the right key. A route added to the app without a row here fails the first test below.
ROUTES: dict[tuple[str, str], tuple[dict[str, object] | None, int]] = {
    ("POST", "/v1/completions"): (PROMPT, 200),
    ("POST", "/v1/chat/completions"): (CHAT, 200),
    ("POST", "/v1/responses"): ({"model": "tiny", "input": "hi", "max_output_tokens": 4}, 200),
    ("POST", "/tokenize"): ({"model": "tiny", "prompt": "hi"}, 200),
    ("POST", "/detokenize"): ({"model": "tiny", "tokens": [104, 105]}, 200),
    ("GET", "/version"): (None, 200),
    # the fake engine runs without --enable-tokenizer-info-endpoint: its 404 passed on
    ("GET", "/tokenizer_info"): (None, 404),
    ("POST", "/invocations"): (CHAT, 200),
    ("POST", "/v1/messages"): (CHAT, 200),
    ("POST", "/v1/chat/completions/batch"): ({**CHAT, "messages": [CHAT["messages"]]}, 200),
    ("GET", "/v1/models"): (None, 200),
    ("GET", "/metrics"): (None, 200),
    ("GET", "/openapi.json"): (None, 200),
    ("GET", "/docs"): (None, 200),
    ("GET", "/docs/oauth2-redirect"): (None, 200),
    ("GET", "/redoc"): (None, 200),
    ("GET", "/health"): (None, 200),
    ("GET", "/ready"): (None, 503),  # health checks are off here: not ready, and says so
    ("GET", "/no/such/route"): (None, 404),
}
PROBES = {"/health", "/ready"}
WRONG_CREDENTIALS = {
    "no key": {},
    "wrong key": {"authorization": f"Bearer {WRONG}"},
    "basic scheme": {"authorization": f"Basic {KEY}"},
    "token scheme": {"authorization": f"Token {KEY}"},
    "no scheme": {"authorization": KEY},
}


async def _ask(
    client: httpx.AsyncClient, url: str, route: tuple[str, str], headers: dict[str, str]
) -> httpx.Response:
    method, path = route
    body, _ = ROUTES[route]
    return await client.request(method, url + path, json=body, headers=headers)


async def test_the_route_table_is_every_route(cluster: Cluster) -> None:
    _, ctx = await cluster.router("pull", auth=AUTH)
    app = create_app(ctx.config, health_checks=False).api
    served = {
        (m, getattr(r, "path", ""))
        for r in app.routes
        for m in (getattr(r, "methods", None) or {"GET"})
        if m != "HEAD"
    }
    assert served == set(ROUTES) - {("GET", "/no/such/route")}


@pytest.mark.parametrize("route", list(ROUTES), ids=lambda r: f"{r[0]} {r[1]}")
async def test_every_route_but_the_probes_needs_the_key(
    cluster: Cluster,
    client: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
    route: tuple[str, str],
) -> None:
    caplog.set_level(logging.DEBUG)
    url, ctx = await cluster.router("pull", auth=AUTH)
    _, status = ROUTES[route]
    probe = route[1] in PROBES
    for name, headers in WRONG_CREDENTIALS.items():
        r = await _ask(client, url, route, headers)
        if probe:
            assert r.status_code == status, name
            continue
        assert r.status_code == 401, (name, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error"
    assert all(e.received == [] for e in cluster.engines)  # nothing reached an engine
    for scheme in ("Bearer", "bearer"):
        r = await _ask(client, url, route, {"authorization": f"{scheme} {KEY}"})
        assert r.status_code == status, r.text
    failures = metric(ctx, "pdrouter_auth_failures_total")
    assert failures == (0 if probe else len(WRONG_CREDENTIALS))
    assert KEY not in caplog.text and WRONG not in caplog.text


async def test_ready_without_a_key_says_only_whether_it_is_ready(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await cluster.router("pull", auth=AUTH)
    for headers in WRONG_CREDENTIALS.values():
        r = await client.get(url + "/ready", headers=headers)
        assert r.json() == {"ready": False}  # no health check has answered yet
    r = await client.get(url + "/ready", headers={"authorization": f"Bearer {KEY}"})
    instances = r.json()["models"]["tiny"]["instances"]
    assert {i["url"] for i in instances} == {*cluster.prefill_urls, *cluster.decode_urls}


async def test_a_key_is_known_by_its_name_never_shown(
    cluster: Cluster, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url, ctx = await cluster.router(
        "pull", auth=AUTH, logging={"access": True}, limits={"per_key": {"max_concurrent": 1}}
    )
    auth = {"authorization": f"Bearer {KEY}"}
    assert (
        await client.post(url + "/v1/completions", json=PROMPT, headers=auth)
    ).status_code == 200
    assert (await client.post(url + "/v1/completions", json=PROMPT)).status_code == 401
    text = (await client.get(url + "/metrics", headers=auth)).text
    assert 'pdrouter_key_requests_total{key="team-a",result="admitted"} 1.0' in text
    assert KEY not in text and KEY not in caplog.text and KEY not in repr(ctx.config)
