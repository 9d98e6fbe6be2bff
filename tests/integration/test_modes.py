"""Each dispatch mode over real sockets: what the engines receive and what the client gets."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.conftest import Cluster, eventually, metric

PROMPT = {"model": "tiny", "prompt": "hello there", "max_tokens": 8}


def sse_payloads(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


async def test_pull_streaming_rewrites_legs_and_relays_sse(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await cluster.router("pull")
    body = {**PROMPT, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 2}
    r = await client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(r.text)
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-2]] == [
        "t0 ",
        "t1 ",
        "t2 ",
        "t3 ",
    ]
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 4  # include_usage, relayed

    (p_req,) = cluster.prefill[0].received
    (d_req,) = cluster.decode[0].received
    assert p_req.body["max_tokens"] == 1 and p_req.body["stream"] is False
    assert "stream_options" not in p_req.body and "min_tokens" not in p_req.body
    assert p_req.kv["do_remote_decode"] is True
    # D gets the client's body unchanged plus P's params verbatim.
    assert d_req.body["stream"] is True and d_req.body["max_tokens"] == 8
    assert d_req.body["min_tokens"] == 2 and d_req.body["stream_options"] == {"include_usage": True}
    assert d_req.kv["remote_block_ids"] == [[1, 2, 3]]
    assert d_req.kv["remote_engine_id"] == "fake-prefill"
    assert p_req.request_id == d_req.request_id == r.headers["x-request-id"]
    assert p_req.kv["transfer_id"] == d_req.kv["transfer_id"]
    # Sequential: D only after P finished.
    assert p_req.ended is not None and d_req.started >= p_req.ended


async def test_client_ids_and_params_never_reach_engines(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await cluster.router("pull")
    body = {**PROMPT, "request_id": "mine", "kv_transfer_params": {"remote_host": "10.9.9.9"}}
    r = await client.post(url + "/v1/completions", json=body, headers={"x-request-id": "mine"})
    assert r.status_code == 200
    for engine in cluster.engines:
        (req,) = engine.received
        assert req.request_id != "mine" and "request_id" not in req.body
        assert req.kv.get("remote_host") != "10.9.9.9"
    r2 = await client.post(url + "/v1/completions", json=PROMPT)
    assert r2.headers["x-request-id"] != r.headers["x-request-id"]


async def overlapping(
    cluster: Cluster, client: httpx.AsyncClient, url: str, body: dict[str, object]
) -> httpx.Response:
    """One request whose P answers only once D holds its leg: the legs provably overlap
    (a router that waited for P would wait forever; the test's deadline fails it)."""
    gate = cluster.prefill[0].behaviour.gate = asyncio.Event()
    seen = len(cluster.decode[0].received)
    answer = asyncio.create_task(client.post(url + "/v1/completions", json=body))
    try:
        await eventually(lambda: len(cluster.decode[0].received) > seen)
        gate.set()
        return await answer
    finally:
        cluster.prefill[0].behaviour.gate = None
        gate.set()
        await asyncio.gather(answer, return_exceptions=True)


async def test_push_concurrent_legs_overlap_with_same_ids(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    cluster.prefill[0].behaviour.transfer_mode = "push"
    url, _ = await cluster.router(
        "push", prefill_extra={"engine_id": "p-0", "kv_host": "127.0.0.2", "kv_port": 5601}
    )
    r = await overlapping(cluster, client, url, {**PROMPT, "stream": True})
    assert r.status_code == 200 and sse_payloads(r.text)[-1] == "[DONE]"
    (p_req,) = cluster.prefill[0].received
    (d_req,) = cluster.decode[0].received
    # Both legs were in flight at the same time.
    assert p_req.ended is not None and d_req.started < p_req.ended
    assert p_req.request_id == d_req.request_id
    assert p_req.kv["transfer_id"] == d_req.kv["transfer_id"]
    assert d_req.kv["do_remote_prefill"] is True and "remote_block_ids" not in d_req.kv
    assert (d_req.kv["remote_engine_id"], d_req.kv["remote_host"], d_req.kv["remote_port"]) == (
        "p-0",
        "127.0.0.2",
        5601,
    )
    assert d_req.kv["remote_request_id"] == f"cmpl-{p_req.request_id}-0"


async def test_push_learns_identity_then_goes_concurrent(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    p = cluster.prefill[0].behaviour
    p.transfer_mode, p.engine_id, p.kv_port = "push", "learned-p", 5999
    url, ctx = await cluster.router("push")
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 200
    r = await overlapping(cluster, client, url, PROMPT)
    assert r.status_code == 200
    (p1, p2) = cluster.prefill[0].received
    (d1, d2) = cluster.decode[0].received
    assert p1.ended is not None and d1.started >= p1.ended  # first: sequential
    assert p2.ended is not None and d2.started < p2.ended  # then: concurrent
    assert d1.kv["remote_request_id"] == f"cmpl-{p1.request_id}-0-1a2b3c4d"
    assert d2.kv["remote_engine_id"] == "learned-p" and d2.kv["remote_port"] == 5999
    assert metric(ctx, "pdrouter_push_sequential_dispatches_total") == 1


async def test_push_sequential_waits_for_prefill(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    cluster.prefill[0].behaviour.transfer_mode = "push"
    url, _ = await cluster.router(
        "push-sequential", prefill_extra={"engine_id": "p", "kv_host": "h", "kv_port": 1}
    )
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 200
    (p_req,) = cluster.prefill[0].received
    (d_req,) = cluster.decode[0].received
    assert p_req.ended is not None and d_req.started >= p_req.ended
    # D reads the request P announced: P's answer's params, verbatim.
    assert d_req.kv["remote_request_id"] == f"cmpl-{p_req.request_id}-0-1a2b3c4d"
    assert (d_req.kv["remote_engine_id"], d_req.kv["remote_port"]) == ("fake-prefill", 5600)


async def test_pipelined_sends_each_leg_the_other_identity(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await cluster.router(
        "pipelined",
        prefill_extra={"engine_id": "P", "kv_host": "10.0.0.1", "kv_port": 7001},
        decode_extra={"engine_id": "D", "kv_host": "10.0.0.2", "kv_port": 7002},
    )
    r = await overlapping(cluster, client, url, PROMPT)
    assert r.status_code == 200
    (p_req,) = cluster.prefill[0].received
    (d_req,) = cluster.decode[0].received
    assert p_req.kv["remote_engine_id"] == "D" and p_req.kv["remote_port"] == 7002
    assert d_req.kv["remote_engine_id"] == "P" and d_req.kv["remote_host"] == "10.0.0.1"
    assert p_req.kv["transfer_id"] == d_req.kv["transfer_id"]
    assert p_req.ended is not None and d_req.started < p_req.ended
    assert "tp_size" not in p_req.kv and "tp_size" not in d_req.kv  # equal sizes: as before


async def test_pipelined_names_the_other_engines_tp_size_where_they_differ(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await cluster.router(
        "pipelined",
        prefill_extra={"engine_id": "P", "kv_host": "10.0.0.1", "kv_port": 7001},
        decode_extra={"engine_id": "D", "kv_host": "10.0.0.2", "kv_port": 7002, "tp_size": 2},
    )
    r = await overlapping(cluster, client, url, PROMPT)
    assert r.status_code == 200
    (p_req,) = cluster.prefill[0].received
    (d_req,) = cluster.decode[0].received
    assert (p_req.kv["tp_size"], p_req.kv["pp_size"]) == (2, 1)  # P learns D's size
    assert (d_req.kv["tp_size"], d_req.kv["pp_size"]) == (1, 1)  # and D P's


async def test_aggregated_never_calls_prefill(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, _ = await cluster.router("aggregated")
    r = await client.post(url + "/v1/completions", json={**PROMPT, "kv_transfer_params": {"x": 1}})
    assert r.status_code == 200
    assert cluster.prefill[0].received == []
    (d_req,) = cluster.decode[0].received
    assert "kv_transfer_params" not in d_req.body


@pytest.mark.parametrize("mode", ["pull", "push", "push-sequential", "pipelined", "aggregated"])
async def test_a_chat_s_prompt_ids_reach_the_engines_and_no_other_client_param_does(
    cluster: Cluster, client: httpx.AsyncClient, mode: str
) -> None:
    """vLLM runs a chat's ``kv_transfer_params.prompt_token_ids`` as its prompt: every leg gets
    them, and nothing else the client put there (issue 44)."""
    ids = {"engine_id": "e", "kv_host": "127.0.0.1", "kv_port": 5600}
    url, _ = await cluster.router(mode, prefill_extra=ids, decode_extra=ids)
    smuggled = {"prompt_token_ids": [5, 6, 7], "remote_host": "evil", "do_remote_decode": True}
    messages = [{"role": "user", "content": "hello there " * 20}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "kv_transfer_params": smuggled}
    r = await client.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    legs = cluster.prefill[0].received + cluster.decode[0].received
    assert len(legs) == (1 if mode == "aggregated" else 2)
    for leg in legs:
        assert leg.kv["prompt_token_ids"] == [5, 6, 7]
        assert leg.kv.get("remote_host") != "evil"
    if mode == "aggregated":
        assert legs[0].body["kv_transfer_params"] == {"prompt_token_ids": [5, 6, 7]}


async def test_short_prompts_and_n_above_one_skip_prefill(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await cluster.router("pull", model={"disagg_min_prompt_tokens": 100})
    assert (await client.post(url + "/v1/completions", json=PROMPT)).status_code == 200
    long_prompt = {**PROMPT, "prompt": "word " * 200}
    assert (await client.post(url + "/v1/completions", json=long_prompt)).status_code == 200
    assert (
        await client.post(url + "/v1/completions", json={**long_prompt, "n": 2})
    ).status_code == 200
    assert len(cluster.prefill[0].received) == 1
    assert len(cluster.decode[0].received) == 3
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision="decode_only_short") == 1
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision="decode_only_n") == 1
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision="pull") == 1


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_openai_sdk_chat_and_completions(cluster: Cluster, mode: str) -> None:
    cluster.prefill[0].behaviour.transfer_mode = mode
    url, _ = await cluster.router(mode)
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        chat = await sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.choices[0].message.content == "t0 t1 t2 t3 "
        stream = await sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        pieces = [c.choices[0].delta.content async for c in stream]
        assert "".join(p or "" for p in pieces) == "t0 t1 t2 t3 "
        comp = await sdk.completions.create(model="tiny", prompt="x", max_tokens=4)
        assert comp.choices[0].text == "t0 t1 t2 t3 "
        models = await sdk.models.list()
        assert [m.id for m in models.data] == ["tiny"]
    finally:
        await sdk.close()
    # Chat legs hit the same endpoint on both engines (push matches by request id + path).
    assert {r.path for r in cluster.prefill[0].received} == {
        "/v1/chat/completions",
        "/v1/completions",
    }


async def test_stream_metrics_count_chunks_and_the_worst_gap(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await cluster.router("pull")
    cluster.decode[0].behaviour.token_delay = 0.05  # each chunk alone on the wire
    r = await client.post(url + "/v1/completions", json={**PROMPT, "stream": True})
    assert r.status_code == 200 and sse_payloads(r.text)[-1] == "[DONE]"
    # 4 tokens and [DONE], ~50 ms apart; the last ones may share one read.
    assert 2 <= metric(ctx, "pdrouter_streamed_chunks_total") <= 5
    assert metric(ctx, "pdrouter_stream_max_chunk_gap_seconds_count") == 1
    worst = metric(ctx, "pdrouter_stream_max_chunk_gap_seconds_sum")
    assert 0.04 <= worst < 5


@pytest.mark.parametrize("mode", ["pull", "push", "pipelined"])
async def test_a_busy_prefill_sends_new_requests_to_d_alone(
    cluster: Cluster, client: httpx.AsyncClient, mode: str
) -> None:
    """With every P at ``disagg_max_prefill_queue`` legs, the next request is served by D
    alone instead of queueing behind them; once P is free again, requests split again."""
    ids = {"engine_id": "e", "kv_host": "127.0.0.1", "kv_port": 5600}
    url, ctx = await cluster.router(
        mode, model={"disagg_max_prefill_queue": 1}, prefill_extra=ids, decode_extra=ids
    )
    gate = cluster.prefill[0].behaviour.gate = asyncio.Event()
    held = asyncio.create_task(client.post(url + "/v1/completions", json=PROMPT))
    await eventually(lambda: len(cluster.prefill[0].received) == 1)  # P holds the first one
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 200 and not held.done()
    assert len(cluster.prefill[0].received) == 1  # the second never went to P
    assert "kv_transfer_params" not in cluster.decode[0].received[-1].body
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision="decode_only_busy") == 1
    gate.set()
    assert (await held).status_code == 200
    assert (await client.post(url + "/v1/completions", json=PROMPT)).status_code == 200
    assert len(cluster.prefill[0].received) == 2
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision=mode) == 2


async def test_d_takes_no_prompt_while_its_own_backlog_is_as_long_as_p_s(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """Join the shorter queue: with P running one leg and D computing one prompt alone, the
    next request goes to P; with P at two legs, D (one prompt) takes the one after."""
    url, ctx = await cluster.router("pull", model={"disagg_max_prefill_queue": 1})
    p_gate = cluster.prefill[0].behaviour.gate = asyncio.Event()
    first = asyncio.create_task(client.post(url + "/v1/completions", json=PROMPT))
    await eventually(lambda: len(cluster.prefill[0].received) == 1)
    d_gate = cluster.decode[0].behaviour.gate = asyncio.Event()
    alone = asyncio.create_task(client.post(url + "/v1/completions", json=PROMPT))
    await eventually(lambda: len(cluster.decode[0].received) == 1)  # D computes it alone
    third = asyncio.create_task(client.post(url + "/v1/completions", json=PROMPT))
    await eventually(lambda: len(cluster.prefill[0].received) == 2)  # to P, not to D
    fourth = asyncio.create_task(client.post(url + "/v1/completions", json=PROMPT))
    await eventually(lambda: len(cluster.decode[0].received) == 2)
    assert "kv_transfer_params" not in cluster.decode[0].received[1].body
    assert len(cluster.prefill[0].received) == 2  # the fourth went to D alone
    p_gate.set()
    d_gate.set()
    for task in (first, alone, third, fourth):
        assert (await task).status_code == 200
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision="decode_only_busy") == 2
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision="pull") == 2
    pool = ctx.registry.get("tiny")
    assert pool is not None and pool.decode[0].prefilling == 0


async def test_a_failed_d_alone_leg_leaves_no_backlog_behind(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """D's backlog count ends with its leg, however it ends: after a D-alone leg failed,
    D takes the next request that finds P busy."""
    url, ctx = await cluster.router("pull", model={"disagg_max_prefill_queue": 1})
    pool = ctx.registry.get("tiny")
    assert pool is not None
    p_gate = cluster.prefill[0].behaviour.gate = asyncio.Event()
    held = asyncio.create_task(client.post(url + "/v1/completions", json=PROMPT))
    await eventually(lambda: len(cluster.prefill[0].received) == 1)
    cluster.decode[0].behaviour.status = 400  # the engine's own answer: no retry, no breaker
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 400 and pool.decode[0].prefilling == 0
    cluster.decode[0].behaviour.status = 200
    assert (await client.post(url + "/v1/completions", json=PROMPT)).status_code == 200
    assert len(cluster.prefill[0].received) == 1  # both went to D alone
    p_gate.set()
    assert (await held).status_code == 200
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision="decode_only_busy") == 2
