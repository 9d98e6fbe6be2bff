"""Routes of ``vllm serve`` 0.32 beyond the three generate endpoints (fake engines on real
sockets): ``GET /tokenizer_info`` forwarded to an engine, ``POST /invocations`` dispatched
by its body's shape through P/D, and the ORCA load report (``endpoint-load-metrics``) of a
non-streamed answer, from D's gauges. The refusals of ``/invocations`` are in the refusal
matrix (tests/integration/test_refusals.py), checked there against vLLM's own route."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import Cluster, metric
from tests.fakes.fake_vllm import FakeEngine

MODES = ["pull", "push", "pipelined"]
IDS = {"engine_id": "e", "kv_host": "127.0.0.1", "kv_port": 5600}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
PROMPT = {"model": "tiny", "prompt": "hello there", "max_tokens": 3}
INFO = {"tokenizer_class": "GPT2TokenizerFast", "model_max_length": 8192}


async def _router(cluster: Cluster, mode: str) -> tuple[str, Any]:
    return await cluster.router(mode, prefill_extra=IDS, decode_extra=IDS)


def _paths(engines: list[FakeEngine]) -> list[str]:
    return [rec.path for e in engines for rec in e.received]


# -- /tokenizer_info ---------------------------------------------------------------------


def _serve_tokenizer_info(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """``engine`` as vLLM with ``--enable-tokenizer-info-endpoint``."""
    plain = engine._get

    async def get(path: str, send: Any) -> None:
        if path != "/tokenizer_info":
            await plain(path, send)
            return
        engine.gets.append(path)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(INFO).encode()})

    monkeypatch.setattr(engine, "_get", get)


async def test_tokenizer_info_is_an_engines_answer(
    cluster: Cluster, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = await cluster.router("pull")
    for engine in cluster.engines:
        _serve_tokenizer_info(engine, monkeypatch)
    r = await client.get(url + "/tokenizer_info")
    assert r.status_code == 200 and r.json() == INFO
    assert sum(e.gets.count("/tokenizer_info") for e in cluster.engines) == 1
    assert _paths(cluster.engines) == []  # no generate call


async def test_tokenizer_info_off_at_the_engine_is_its_404(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """vLLM serves it only with ``--enable-tokenizer-info-endpoint``: the router says what
    its engines say."""
    url, _ = await cluster.router("pull")
    r = await client.get(url + "/tokenizer_info")
    assert r.status_code == 404
    assert sum(e.gets.count("/tokenizer_info") for e in cluster.engines) == 1


# -- /invocations ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_an_invocation_with_messages_is_a_chat_completion_through_p_d(
    cluster: Cluster, client: httpx.AsyncClient, mode: str
) -> None:
    url, ctx = await _router(cluster, mode)
    r = await client.post(url + "/invocations", json=CHAT)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"
    assert _paths(cluster.prefill) == ["/v1/chat/completions"]
    assert _paths(cluster.decode) == ["/v1/chat/completions"]
    d_leg = cluster.decode[0].received[0].body
    assert d_leg["messages"] == CHAT["messages"] and "kv_transfer_params" in d_leg
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision=mode) == 1
    assert metric(ctx, "pdrouter_requests_total", model="tiny", outcome="success") == 1


@pytest.mark.parametrize("mode", MODES)
async def test_an_invocation_with_a_prompt_is_a_completion_through_p_d(
    cluster: Cluster, client: httpx.AsyncClient, mode: str
) -> None:
    url, ctx = await _router(cluster, mode)
    r = await client.post(url + "/invocations", json=PROMPT)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"
    assert _paths(cluster.prefill) == ["/v1/completions"]
    assert _paths(cluster.decode) == ["/v1/completions"]
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision=mode) == 1


@pytest.mark.parametrize("mode", MODES)
async def test_a_streamed_invocation_streams(
    cluster: Cluster, client: httpx.AsyncClient, mode: str
) -> None:
    url, _ = await _router(cluster, mode)
    r = await client.post(url + "/invocations", json={**CHAT, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2
    assert json.loads(events[0].removeprefix("data: "))["object"] == "chat.completion.chunk"


async def test_an_invocation_over_the_context_is_refused_as_chat_is(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await _router(cluster, "pull")
    r = await client.post(url + "/invocations", json={**CHAT, "max_tokens": 10**6})
    chat = await client.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 10**6})
    assert r.status_code == chat.status_code == 400
    assert r.json() == chat.json()
    assert _paths(cluster.engines).count("/v1/chat/completions") == 0


async def test_a_get_of_invocations_is_refused(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, _ = await _router(cluster, "pull")
    r = await client.get(url + "/invocations")
    assert r.status_code == 405 and "POST /invocations" in r.json()["error"]["message"]


# -- ORCA load reports -------------------------------------------------------------------

FORMAT = "endpoint-load-metrics-format"
REPORT = "endpoint-load-metrics"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/invocations"])
async def test_a_load_report_is_ds(
    cluster: Cluster, client: httpx.AsyncClient, mode: str, path: str
) -> None:
    url, _ = await _router(cluster, mode)
    cluster.decode[0].behaviour.waiting = 3
    cluster.decode[0].behaviour.kv_usage = 0.25
    cluster.prefill[0].behaviour.kv_usage = 0.75  # not P's: D made the answer
    body = PROMPT if path == "/v1/completions" else CHAT
    r = await client.post(url + path, json=body, headers={FORMAT: "TEXT"})
    assert r.status_code == 200, r.text
    assert r.headers[REPORT] == (
        "TEXT named_metrics.num_requests_waiting=3.0, named_metrics.kv_cache_usage_perc=0.25"
    )
    r = await client.post(url + path, json=body, headers={FORMAT: "json"})
    assert r.status_code == 200, r.text
    assert r.headers[REPORT] == (
        'JSON {"named_metrics": {"num_requests_waiting": 3.0, "kv_cache_usage_perc": 0.25}}'
    )
    assert "/metrics" in cluster.decode[0].gets


async def test_a_load_report_only_where_vllm_sends_one(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """Not without the header, not in another format, not on a streamed answer, not on the
    Responses API, not on a refusal."""
    url, _ = await _router(cluster, "pull")
    for body, headers in (
        (CHAT, {}),
        (CHAT, {FORMAT: "xml"}),
        ({**CHAT, "stream": True}, {FORMAT: "TEXT"}),
    ):
        r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200 and REPORT not in r.headers, (body, headers)
    r = await client.post(
        url + "/v1/responses",
        json={"model": "tiny", "input": "hi", "max_output_tokens": 3},
        headers={FORMAT: "TEXT"},
    )
    assert r.status_code == 200 and REPORT not in r.headers
    r = await client.post(
        url + "/v1/chat/completions", json={**CHAT, "n": 0}, headers={FORMAT: "TEXT"}
    )
    assert r.status_code == 400 and REPORT not in r.headers
    assert "/metrics" not in cluster.decode[0].gets


async def test_a_load_report_that_cannot_be_read_costs_the_header_not_the_answer(
    cluster: Cluster, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = await _router(cluster, "pull")
    engine = cluster.decode[0]
    plain = engine._get

    async def get(path: str, send: Any) -> None:
        if path != "/metrics":
            await plain(path, send)
            return
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    monkeypatch.setattr(engine, "_get", get)
    r = await client.post(url + "/v1/chat/completions", json=CHAT, headers={FORMAT: "TEXT"})
    assert r.status_code == 200 and REPORT not in r.headers
    assert r.json()["object"] == "chat.completion"
