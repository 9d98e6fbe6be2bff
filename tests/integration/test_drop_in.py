"""What a client of ``vllm serve`` finds through the router (fake engines on real sockets):
numbers unchanged, vLLM's leniency, the endpoints that need no P/D, a 404 that says what
exists, and every refused request counted."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import sys
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from router.app import create_app
from router.config import parse_config
from tests.conftest import Cluster, metric, serve
from tests.needs import missing

PROMPT = {"model": "tiny", "prompt": "hello there", "max_tokens": 3}
BIG = 123456789012345678901234567890


@pytest.mark.parametrize("mode", ["pull", "push", "aggregated"])
async def test_integers_past_64_bits_reach_the_engines_unchanged(
    cluster: Cluster, client: httpx.AsyncClient, mode: str
) -> None:
    url, _ = await cluster.router(mode)
    raw = json.dumps({**PROMPT, "seed": BIG, "logit_bias": {"5": 2**64}})
    r = await client.post(
        url + "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert r.status_code == 200, r.text
    legs = [rec.body for e in cluster.engines for rec in e.received]
    assert legs and all(b["seed"] == BIG and b["logit_bias"] == {"5": 2**64} for b in legs)
    assert all(isinstance(b["seed"], int) for b in legs)


async def test_lenient_like_vllm(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, _ = await cluster.router("pull")
    r = await client.post(url + "/v1/completions", json={**PROMPT, "max_tokens": "3"})
    assert r.status_code == 200, r.text
    r = await client.post(url + "/v1/completions", json={**PROMPT, "stream": 1})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    # The D leg carries the client's fields as sent: vLLM parses them the same way.
    assert cluster.decode[0].received[-1].body["stream"] == 1


async def test_a_request_without_model_goes_to_the_only_model(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await cluster.router("pull")
    body = {k: v for k, v in PROMPT.items() if k != "model"}
    r = await client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert metric(ctx, "pdrouter_requests_total", model="tiny", outcome="success") == 1


async def test_without_model_several_models_is_a_400(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    cfg = cluster.config("aggregated")
    cfg["models"].append({**cfg["models"][0], "name": "other"})
    url = await cluster.stack.enter_async_context(
        serve(create_app(parse_config(cfg), health_checks=False))
    )
    r = await client.post(url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "model" and "other, tiny" in err["message"]


async def test_a_bad_prompt_names_the_field_only(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await cluster.router("pull")
    r = await client.post(url + "/v1/completions", json={**PROMPT, "prompt": 5})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "body.prompt" and err["message"].startswith("prompt: must be a string")


async def test_every_refused_request_is_counted(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await cluster.router("pull")
    assert (await client.post(url + "/v1/completions", content=b"{")).status_code == 400
    bad_model = {**PROMPT, "model": "nope"}
    assert (await client.post(url + "/v1/completions", json=bad_model)).status_code == 404
    bad_n = {**PROMPT, "n": 0}
    assert (await client.post(url + "/v1/completions", json=bad_n)).status_code == 400
    assert metric(ctx, "pdrouter_requests_total", model="", outcome="client_error") == 3
    assert all(e.received == [] for e in cluster.engines)


@pytest.mark.parametrize("mode", ["pull", "aggregated"])
async def test_tokenize_and_detokenize_go_to_an_engine_of_the_model(
    cluster: Cluster, client: httpx.AsyncClient, mode: str
) -> None:
    url, _ = await cluster.router(mode)
    r = await client.post(url + "/tokenize", json={"model": "tiny", "prompt": "hi", "x": 1})
    assert r.status_code == 200 and r.json()["tokens"] == list(b"hi")
    r = await client.post(url + "/detokenize", json={"model": "tiny", "tokens": list(b"ok")})
    assert r.status_code == 200 and r.json() == {"prompt": "ok"}
    received = [rec for e in cluster.engines for rec in e.received]
    assert [rec.path for rec in received] == ["/tokenize", "/detokenize"]
    assert received[0].body == {"model": "tiny", "prompt": "hi", "x": 1}  # as sent


async def test_passthrough_errors(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, _ = await cluster.router("pull")
    r = await client.post(url + "/tokenize", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    cluster.decode[0].behaviour.status = 400  # the engine's own 4xx passes through as is
    cluster.decode[0].behaviour.error_body = b'{"error": {"message": "bad tokens"}}'
    r = await client.post(url + "/detokenize", json={"model": "tiny", "tokens": [-1]})
    assert r.status_code == 400 and r.json() == {"error": {"message": "bad tokens"}}
    cluster.decode[0].behaviour.status = 500  # an engine failure is the router's 502
    r = await client.post(url + "/tokenize", json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 502 and "decode engine" in r.json()["error"]["message"]


async def test_version_is_the_engines(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, _ = await cluster.router("pull")
    r = await client.get(url + "/version")
    assert r.status_code == 200 and r.json() == {"version": "0.32.0"}


async def test_an_unknown_path_lists_what_the_router_serves(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await cluster.router("pull")
    r = await client.post(url + "/v1/embeddings", json=PROMPT)
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert message.startswith("POST /v1/embeddings")
    for served in ("POST /v1/completions", "POST /tokenize", "GET /version", "GET /v1/models"):
        assert served in message


PREFLIGHT = {"access-control-request-method": "POST"}


def _cors_view(r: httpx.Response) -> tuple[int, str, dict[str, str]]:
    """What a browser reads of an answer: status, body, CORS headers."""
    wanted = {k: v for k, v in r.headers.items() if k.startswith("access-control-") or k == "vary"}
    return r.status_code, r.text, wanted


async def test_cors_is_closed_by_default_as_in_vllm_serve(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """vLLM 0.32 allows no origin unless --allowed-origins says so: its preflight is a 400."""
    url, _ = await cluster.router("pull")
    origin = {"origin": "http://evil.test"}
    r = await client.options(url + "/v1/completions", headers={**origin, **PREFLIGHT})
    assert (r.status_code, r.text) == (400, "Disallowed CORS origin")
    assert "access-control-allow-origin" not in r.headers
    # A simple request is served (browsers enforce CORS), but without the header that
    # would let a page read it: on the generate routes (which bypass FastAPI) and others.
    r = await client.post(url + "/v1/completions", json=PROMPT, headers=origin)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = await client.get(url + "/v1/models", headers=origin)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


async def test_cors_opened_by_the_config(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, _ = await cluster.router("pull", cors={"allowed_origins": ["https://ok.example"]})
    ok = {"origin": "https://ok.example"}
    r = await client.options(url + "/v1/chat/completions", headers={**ok, **PREFLIGHT})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ok.example"
    body = {**PROMPT, "stream": True}
    r = await client.post(url + "/v1/completions", json=body, headers=ok)
    assert r.headers["access-control-allow-origin"] == "https://ok.example"
    assert r.text.rstrip().endswith("data: [DONE]")
    other = {"origin": "https://evil.example"}
    r = await client.post(url + "/v1/completions", json=PROMPT, headers=other)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = await client.options(url + "/v1/completions", headers={**other, **PREFLIGHT})
    assert r.status_code == 400
    anyone, _ = await cluster.router("pull", cors={"allowed_origins": ["*"]})
    r = await client.options(anyone + "/v1/completions", headers={**other, **PREFLIGHT})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


@contextlib.asynccontextmanager
async def _vllm_middleware(overrides: dict[str, object]) -> AsyncIterator[str]:
    """vLLM's own middleware stack (tests/fakes/vllm_reference.py) in a process of its own."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.fakes.vllm_reference",
        "0",
        json.dumps(overrides),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 90)  # importing vLLM: seconds
        assert line.strip().isdigit(), await proc.stderr.read()  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{int(line)}"
        async with httpx.AsyncClient() as c:
            deadline = time.monotonic() + 90  # importing vLLM takes seconds
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get(url + "/health")).status_code == 200:
                        break
                assert proc.returncode is None, await proc.stderr.read()  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "vLLM's middleware did not start"
                await asyncio.sleep(0.2)
        yield url
    finally:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 10)


async def test_cors_answers_as_vllm_serve_does(cluster: Cluster, client: httpx.AsyncClient) -> None:
    """The drop-in conformance check: the same preflights and simple requests, answered
    by the router and by vLLM 0.32's own middleware, closed (the default) and opened."""
    if importlib.util.find_spec("vllm") is None:  # in CI: a failure, not a skip
        missing("needs vLLM: run scripts/setup.sh (engine-cpu extra)")
    asks = [
        ("OPTIONS", {"origin": "https://ok.example", **PREFLIGHT}),
        ("OPTIONS", {"origin": "https://evil.example", **PREFLIGHT}),
        (
            "OPTIONS",
            {
                "origin": "https://ok.example",
                **PREFLIGHT,
                "access-control-request-headers": "authorization",
            },
        ),
        ("POST", {"origin": "https://ok.example"}),
        ("POST", {"origin": "https://evil.example"}),
    ]
    for cors in ({}, {"allowed_origins": ["https://ok.example"], "allow_credentials": True}):
        url, _ = await cluster.router("aggregated", cors=cors)
        async with _vllm_middleware(cors) as vllm_url:
            for method, headers in asks:
                answers = [
                    await client.request(
                        method, base + "/v1/completions", json=PROMPT, headers=headers
                    )
                    for base in (url, vllm_url)
                ]
                ours, theirs = (_cors_view(a) for a in answers)
                if method == "POST":  # bodies differ: a fake engine's answer against a stub
                    ours, theirs = ours[::2], theirs[::2]
                assert ours == theirs, (cors, method, headers)


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_api_is_disaggregated_in_pull_mode(
    cluster: Cluster, client: httpx.AsyncClient, stream: bool
) -> None:
    url, ctx = await cluster.router("pull")
    body = {"model": "tiny", "input": "hello there", "max_output_tokens": 5, "stream": stream}
    r = await client.post(url + "/v1/responses", json=body)
    assert r.status_code == 200, r.text
    (p_leg,), (d_leg,) = cluster.prefill[0].received, cluster.decode[0].received
    assert p_leg.path == d_leg.path == "/v1/responses"
    assert p_leg.body["max_output_tokens"] == 1 and "max_tokens" not in p_leg.body
    assert p_leg.body["stream"] is False and p_leg.body["store"] is False
    assert p_leg.body["request_id"] == f"resp_{p_leg.request_id}"  # the id vLLM uses there
    assert {k: v for k, v in d_leg.body.items() if k != "kv_transfer_params"} == body
    assert d_leg.kv["remote_block_ids"]  # P's params, for D to read
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision="pull") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_api_is_disaggregated_in_pipelined_mode(
    cluster: Cluster, client: httpx.AsyncClient, stream: bool
) -> None:
    ids = {"engine_id": "e", "kv_host": "h", "kv_port": 1}
    url, ctx = await cluster.router("pipelined", prefill_extra=ids, decode_extra=ids)
    body = {"model": "tiny", "input": "hello there", "max_output_tokens": 5, "stream": stream}
    r = await client.post(url + "/v1/responses", json=body)
    assert r.status_code == 200, r.text
    (p_leg,), (d_leg,) = cluster.prefill[0].received, cluster.decode[0].received
    assert p_leg.path == d_leg.path == "/v1/responses"
    assert p_leg.body["max_output_tokens"] == 1 and p_leg.body["store"] is False
    assert {k: v for k, v in d_leg.body.items() if k != "kv_transfer_params"} == body
    # Each leg names the other engine; the connector pairs them by the one transfer id.
    assert p_leg.kv["transfer_id"] == d_leg.kv["transfer_id"]
    assert p_leg.kv["do_remote_decode"] is True and d_leg.kv["do_remote_prefill"] is True
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision="pipelined") == 1


@pytest.mark.parametrize("mode", ["push", "push-sequential"])
async def test_responses_api_goes_to_d_alone_in_push_modes(
    cluster: Cluster, client: httpx.AsyncClient, mode: str
) -> None:
    ids = {"engine_id": "e", "kv_host": "h", "kv_port": 1}
    url, ctx = await cluster.router(mode, prefill_extra=ids, decode_extra=ids)
    body = {"model": "tiny", "input": "hello there", "max_output_tokens": 5}
    r = await client.post(url + "/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert cluster.prefill[0].received == []
    (d_leg,) = cluster.decode[0].received
    assert d_leg.body == body  # no kv_transfer_params: D computes the prompt itself
    decision = "decode_only_endpoint"
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision=decision) == 1


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_several_prompts_one_dispatch_each_merged_as_vllm_answers(
    cluster: Cluster, client: httpx.AsyncClient, mode: str
) -> None:
    for e in cluster.engines:
        e.behaviour.prompt_tag, e.behaviour.tokens = True, 2
    url, ctx = await cluster.router(mode)
    body = {**PROMPT, "prompt": ["aa", "bb", "cc"], "max_tokens": 2}
    r = await client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert [(c["index"], c["text"]) for c in doc["choices"]] == [
        (0, "aa:t0 aa:t1 "),
        (1, "bb:t0 bb:t1 "),
        (2, "cc:t0 cc:t1 "),
    ]
    assert doc["usage"] == {"prompt_tokens": 15, "completion_tokens": 6, "total_tokens": 21}
    assert sorted(rec.body["prompt"] for rec in cluster.decode[0].received) == ["aa", "bb", "cc"]
    assert len(cluster.prefill[0].received) == 3  # one dispatch per prompt, each with its P leg
    assert metric(ctx, "pdrouter_requests_total", outcome="success") == 1  # one client request


async def test_several_prompts_streamed(cluster: Cluster, client: httpx.AsyncClient) -> None:
    for e in cluster.engines:
        e.behaviour.prompt_tag, e.behaviour.tokens = True, 3
    url, ctx = await cluster.router("pull")
    body = {
        **PROMPT,
        "prompt": ["aa", "bb"],
        "n": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = await client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1  # one id for the whole stream, as vLLM's
    texts: dict[int, str] = {}
    for c in chunks[:-1]:
        for choice in c["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "aa:t0 aa:t1 aa:t2 ", 1: "bb:t0 bb:t1 bb:t2 "}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert metric(ctx, "pdrouter_requests_total", outcome="success") == 1


async def test_several_prompts_one_fails(cluster: Cluster, client: httpx.AsyncClient) -> None:
    cluster.decode[0].behaviour.poison = "bb"  # D answers 500 to the prompt "bb" only
    url, ctx = await cluster.router("pull")
    r = await client.post(url + "/v1/completions", json={**PROMPT, "prompt": ["aa", "bb"]})
    assert r.status_code == 502 and r.json()["error"]["code"] == 500  # D's answer to "bb"
    r = await client.post(
        url + "/v1/completions", json={**PROMPT, "prompt": ["aa", "bb"], "stream": True}
    )
    # The stream had not started: a whole error response.
    assert r.status_code == 502 and r.json()["error"]["code"] == 500
    assert ctx.registry.slots_in_use() == 0
    assert metric(ctx, "pdrouter_requests_total", outcome="upstream_error") == 2


@pytest.mark.parametrize("mode", ["push", "push-sequential", "pipelined", "pull"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_cached_tokens_are_prefills_not_the_transfer(
    cluster: Cluster, client: httpx.AsyncClient, mode: str, stream: bool
) -> None:
    """D counts KV that came over the transfer as cached (vLLM 0.32: all 5 prompt tokens);
    an aggregated engine would report its own prefix-cache hits, P's here (2). In pull,
    vLLM's D already reports P's count from P's params, so the router leaves it alone."""
    cluster.prefill[0].behaviour.cached_tokens = 2
    cluster.decode[0].behaviour.cached_tokens = 5
    ids = {"engine_id": "e", "kv_host": "127.0.0.1", "kv_port": 5600}
    url, _ = await cluster.router(mode, prefill_extra=ids, decode_extra=ids)
    body = {**PROMPT, "stream": stream, "stream_options": {"include_usage": True}}
    if not stream:
        del body["stream_options"]
    r = await client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
    else:
        usage = r.json()["usage"]
    want = 5 if mode == "pull" else 2
    assert usage["prompt_tokens_details"] == {"cached_tokens": want}
    assert usage["prompt_tokens"] == 5  # the rest of usage unchanged
