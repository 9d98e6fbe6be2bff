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


# -- /v1/chat/completions/batch ----------------------------------------------------------

BATCH = "/v1/chat/completions/batch"
CONVERSATIONS = [
    [{"role": "user", "content": "one"}],
    [{"role": "user", "content": "two"}, {"role": "assistant", "content": "2"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "three"}],
]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


@pytest.mark.parametrize("mode", MODES)
async def test_a_batch_is_one_p_d_dispatch_per_conversation(
    cluster: Cluster, client: httpx.AsyncClient, mode: str
) -> None:
    url, ctx = await _router(cluster, mode)
    extra = {"logprobs": True, "top_logprobs": 2, "return_token_ids": True}
    body = {"model": "tiny", "messages": CONVERSATIONS, "max_tokens": 3, **extra}
    r = await client.post(url + BATCH, json={**body, "response_format": SCHEMA})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["object"] == "chat.completion" and doc["model"] == "tiny"
    assert [c["index"] for c in doc["choices"]] == [0, 1, 2]
    assert all(c["message"]["role"] == "assistant" for c in doc["choices"])
    usage = doc["usage"]
    made = cluster.decode[0].behaviour.tokens  # per conversation, as the fake answers
    assert usage["completion_tokens"] == 3 * made and usage["prompt_tokens_details"] is None
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # each conversation a chat completion of its own, through P and D, the fields passed on
    for engines in (cluster.prefill, cluster.decode):
        legs = [rec.body for e in engines for rec in e.received]
        assert sorted(json.dumps(b["messages"]) for b in legs) == sorted(
            json.dumps(c) for c in CONVERSATIONS
        )
    for leg in (rec.body for e in cluster.decode for rec in e.received):
        assert {k: leg[k] for k in extra} == extra and leg["response_format"] == SCHEMA
        assert "stream" not in leg and "kv_transfer_params" in leg
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision=mode) == 3
    assert metric(ctx, "pdrouter_requests_total", model="tiny", outcome="success") == 1
    assert ctx.registry.slots_in_use() == 0


async def test_a_batch_is_never_streamed(cluster: Cluster, client: httpx.AsyncClient) -> None:
    """vLLM's batch request model has no ``stream``: an answer in one piece."""
    url, _ = await _router(cluster, "pull")
    body = {"model": "tiny", "messages": CONVERSATIONS[:2], "stream": True, "max_tokens": 2}
    r = await client.post(url + BATCH, json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert all("stream" not in rec.body for rec in cluster.decode[0].received)
    assert all(not rec.body.get("stream") for rec in cluster.prefill[0].received)


async def test_a_batch_in_aggregated_mode_is_split_too(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await cluster.router("aggregated")
    r = await client.post(url + BATCH, json={"model": "tiny", "messages": CONVERSATIONS})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    paths = _paths(cluster.engines)
    assert paths == ["/v1/chat/completions"] * 3


async def test_a_conversation_that_fails_fails_the_batch(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await _router(cluster, "pull")
    cluster.decode[0].behaviour.status = 400
    cluster.decode[0].behaviour.error_body = b'{"error": {"message": "bad", "code": 400}}'
    r = await client.post(url + BATCH, json={"model": "tiny", "messages": CONVERSATIONS})
    assert r.status_code == 400 and "choices" not in r.json()
    assert ctx.registry.slots_in_use() == 0


async def test_a_batch_longer_than_max_prompts_is_refused_before_any_work(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await cluster.router("pull", limits={"max_prompts": 2})
    r = await client.post(url + BATCH, json={"model": "tiny", "messages": CONVERSATIONS})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"
    assert _paths(cluster.engines) == []
    assert metric(ctx, "pdrouter_bounds_refusals_total", bound="prompts") == 1


# -- /v1/messages ------------------------------------------------------------------------

MESSAGES = {
    "model": "tiny",
    "system": "be brief",
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    "max_tokens": 5,
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["pull", "pipelined"])
async def test_a_message_runs_both_legs_on_the_engines_messages_route(
    cluster: Cluster, client: httpx.AsyncClient, mode: str, stream: bool
) -> None:
    """vLLM 0.32's Anthropic request model takes ``kv_transfer_params`` (its P leg: one token,
    not streamed) and answers them: the engines' own route runs each leg, D's answer (its
    stream too) reaches the client as D sent it."""
    url, ctx = await _router(cluster, mode)
    r = await client.post(url + "/v1/messages", json={**MESSAGES, "stream": stream})
    assert r.status_code == 200, r.text
    assert _paths(cluster.prefill) == _paths(cluster.decode) == ["/v1/messages"]
    p_leg = cluster.prefill[0].received[0].body
    assert (p_leg["max_tokens"], p_leg["stream"]) == (1, False)
    assert p_leg["kv_transfer_params"]["do_remote_decode"] is True
    d_leg = cluster.decode[0].received[0].body
    assert {k: d_leg[k] for k in MESSAGES} == MESSAGES and d_leg.get("stream") == stream
    assert "kv_transfer_params" in d_leg
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision=mode) == 1


async def test_a_message_in_push_mode_is_d_alone(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """Push modes split completions and chat only (docs/vllm-compatibility.md)."""
    url, ctx = await _router(cluster, "push")
    r = await client.post(url + "/v1/messages", json=MESSAGES)
    assert r.status_code == 200, r.text
    assert _paths(cluster.prefill) == [] and _paths(cluster.decode) == ["/v1/messages"]
    assert "kv_transfer_params" not in cluster.decode[0].received[0].body
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision="decode_only_endpoint") == 1


async def test_a_message_gets_no_load_report(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, _ = await _router(cluster, "pull")
    r = await client.post(url + "/v1/messages", json=MESSAGES, headers={FORMAT: "TEXT"})
    assert r.status_code == 200 and REPORT not in r.headers
