"""Failure paths over real sockets. After each, the cluster fixture asserts that every
slot is free and the fake engines saw every upstream connection closed."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time

import httpx
import pytest

from router.config import BreakerConfig, HealthConfig
from tests.conftest import Cluster, client_leaves, eventually, metric, stream_error

PROMPT = {"model": "tiny", "prompt": "hello there", "max_tokens": 8}


def error_of(r: httpx.Response) -> dict[str, object]:
    err = r.json()["error"]
    assert {"message", "type", "code"} <= set(err)
    return err  # type: ignore[no-any-return]


# -- client errors -------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "type_"),
    [
        # vLLM's request validation (FastAPI's) types these "Bad Request" (test_refusals.py)
        (b"{not json", 400, "Bad Request"),
        (b"[1, 2]", 400, "Bad Request"),
        (json.dumps({"model": "tiny"}).encode(), 400, "BadRequestError"),
        (json.dumps({**PROMPT, "max_tokens": "many"}).encode(), 400, "Bad Request"),
        (json.dumps({**PROMPT, "stream": "maybe"}).encode(), 400, "Bad Request"),
        (json.dumps({**PROMPT, "prompt": [["a"]]}).encode(), 400, "Bad Request"),
        (json.dumps({**PROMPT, "model": "nope"}).encode(), 404, "NotFoundError"),
        (b"\xff\xfe\xfa", 400, "Bad Request"),
    ],
)
async def test_bad_requests_get_openai_errors_and_touch_no_engine(
    cluster: Cluster, client: httpx.AsyncClient, body: bytes, status: int, type_: str
) -> None:
    """Typed and coded as vLLM's own: a client cannot tell the router's 4xx from an engine's."""
    url, _ = await cluster.router("pull")
    r = await client.post(url + "/v1/completions", content=body)
    assert r.status_code == status
    assert error_of(r)["type"] == type_ and error_of(r)["code"] == status
    assert all(e.received == [] for e in cluster.engines)


async def test_unknown_model_is_answered_in_vllms_words(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await cluster.router("pull")
    r = await client.post(url + "/v1/completions", json={**PROMPT, "model": "nope"})
    assert r.json() == {
        "error": {
            "message": "The model `nope` does not exist. Valid aliases: tiny.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


async def test_api_keys(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, _ = await cluster.router("pull", auth={"api_keys": ["k1", "k2"]})
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 401 and error_of(r)["type"] == "authentication_error"
    r = await client.post(
        url + "/v1/completions", json=PROMPT, headers={"authorization": "Bearer kx"}
    )
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    r = await client.post(
        url + "/v1/completions", json=PROMPT, headers={"authorization": "Bearer k2"}
    )
    assert r.status_code == 200
    assert (await client.get(url + "/health")).status_code == 200  # probes need no key


async def test_body_size_limit(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, _ = await cluster.router("pull", admission={"max_body_bytes": 2048})
    r = await client.post(url + "/v1/completions", json={**PROMPT, "prompt": "x" * 4096})
    assert r.status_code == 413 and error_of(r)["code"] == 413


async def test_unknown_route_is_openai_shaped(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, _ = await cluster.router("pull")
    r = await client.get(url + "/v1/nothing")
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"


async def test_prefill_4xx_passes_through(cluster: Cluster, client: httpx.AsyncClient) -> None:
    b = cluster.prefill[0].behaviour
    b.status = 400
    b.error_body = (
        b'{"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}'
    )
    url, _ = await cluster.router("pull", retries={"max_attempts": 3})
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 400 and error_of(r)["message"] == "prompt too long"
    assert len(cluster.prefill[0].received) == 1  # a client error is not retried
    assert cluster.decode[0].received == []


# -- upstream failures before the first byte -------------------------------------


async def test_prefill_5xx_on_the_only_prefill_is_502_without_a_retry(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """A retry on the same, only P cannot help: its own answer reaches the client."""
    cluster.prefill[0].behaviour.status = 500
    url, ctx = await cluster.router("pull", retries={"max_attempts": 2, "backoff_initial": 0})
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 502 and error_of(r)["code"] == 500
    assert "127.0.0.1" not in r.text  # engine URLs go to the log, not to clients
    assert len(cluster.prefill[0].received) == 1
    assert cluster.decode[0].received == []
    assert metric(ctx, "pdrouter_retries_total") == 0
    assert metric(ctx, "pdrouter_requests_total", outcome="upstream_error") == 1


async def test_prefill_5xx_is_retried_on_another_prefill(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    for p in cluster2.prefill:
        p.behaviour.status = 500
    url, ctx = await cluster2.router("pull", retries={"max_attempts": 3, "backoff_initial": 0})
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 502
    # Each P once: the third attempt would have gone back to one already tried.
    assert [len(p.received) for p in cluster2.prefill] == [1, 1]
    assert metric(ctx, "pdrouter_retries_total") == 1


async def test_retry_reselects_another_prefill(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    cluster2.prefill[0].behaviour.status = 503
    url, ctx = await cluster2.router(
        "pull",
        retries={"max_attempts": 2, "backoff_initial": 0},
        model={"policy": {"prefill": "round_robin"}},
    )
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 200
    (first,) = cluster2.prefill[0].received
    (second,) = cluster2.prefill[1].received
    assert first.request_id != second.request_id  # fresh ids per attempt
    assert first.kv["transfer_id"] != second.kv["transfer_id"]
    assert metric(ctx, "pdrouter_retries_total") == 1


async def test_missing_kv_params_is_an_error_not_a_recompute(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    cluster.prefill[0].behaviour.omit_kv_params = True
    url, ctx = await cluster.router("pull")
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 502 and error_of(r)["code"] == "kv_transfer_params_missing"
    assert cluster.decode[0].received == []
    assert metric(ctx, "pdrouter_kv_params_missing_total") == 1


async def test_malformed_prefill_json_is_502(cluster: Cluster, client: httpx.AsyncClient) -> None:
    cluster.prefill[0].behaviour.malformed_json = True
    url, _ = await cluster.router("pull")
    r = await client.post(url + "/v1/completions", json=PROMPT)
    # Not JSON: no params D could read its KV with (counted as missing, not recomputed).
    assert r.status_code == 502 and error_of(r)["code"] == "kv_transfer_params_missing"
    assert cluster.decode[0].received == []


async def test_prefill_hang_times_out_with_504(cluster: Cluster, client: httpx.AsyncClient) -> None:
    cluster.prefill[0].behaviour.hang = True
    url, _ = await cluster.router("pull", timeouts={"prefill": 0.5})
    t0 = time.monotonic()
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 504 and error_of(r)["code"] == "prefill_timeout"
    assert time.monotonic() - t0 < 2.0
    await eventually(lambda: cluster.prefill[0].received[0].closed_by_client)


async def test_prefill_unreachable_is_502(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, _ = await cluster.router("pull")
    ctx = cluster.routers[-1]
    pool = ctx.registry.get("tiny")
    assert pool is not None
    pool.prefill[0].url = "http://127.0.0.1:9"  # nothing listens on the discard port
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 502 and error_of(r)["code"] == "prefill_unreachable"


async def test_decode_5xx_is_passed_as_error(cluster: Cluster, client: httpx.AsyncClient) -> None:
    cluster.decode[0].behaviour.status = 500
    url, _ = await cluster.router("pull")
    r = await client.post(url + "/v1/completions", json={**PROMPT, "stream": True})
    assert r.status_code == 502 and "d0 failed" in str(error_of(r)["message"])


async def test_decode_first_byte_timeout(cluster: Cluster, client: httpx.AsyncClient) -> None:
    cluster.decode[0].behaviour.hang = True
    url, _ = await cluster.router("pull", timeouts={"decode_first_byte": 0.5})
    r = await client.post(url + "/v1/completions", json={**PROMPT, "stream": True})
    assert r.status_code == 504 and error_of(r)["code"] == "decode_first_byte_timeout"
    await eventually(lambda: cluster.decode[0].received[0].closed_by_client)


# -- push: P fails while D waits -------------------------------------------------


async def test_push_prefill_failure_closes_decode(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    p = cluster.prefill[0].behaviour
    p.gate, p.status = asyncio.Event(), 500
    url, ctx = await cluster.router(
        "push", prefill_extra={"engine_id": "p", "kv_host": "h", "kv_port": 1}
    )
    body = {**PROMPT, "stream": True}
    answer = asyncio.create_task(client.post(url + "/v1/completions", json=body))
    await eventually(lambda: len(cluster.decode[0].received) == 1)  # D waits for its KV
    p.gate.set()
    r = await answer
    # P's own failure (not D's first-byte timeout, 5 s away): D is closed at once.
    assert r.status_code == 502 and error_of(r)["code"] == 500
    (d_req,) = cluster.decode[0].received
    await eventually(lambda: d_req.closed_by_client)  # D was waiting for KV; now aborted
    pool = ctx.registry.get("tiny")
    assert pool is not None and pool.decode[0].suspect


async def test_push_prefill_timeout_is_504_and_closes_decode(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    cluster.prefill[0].behaviour.hang = True
    url, _ = await cluster.router(
        "push",
        prefill_extra={"engine_id": "p", "kv_host": "h", "kv_port": 1},
        timeouts={"prefill": 0.4},
    )
    r = await client.post(url + "/v1/completions", json={**PROMPT, "stream": True})
    assert r.status_code == 504 and error_of(r)["code"] == "prefill_timeout"
    await eventually(lambda: cluster.decode[0].received[0].closed_by_client)
    await eventually(lambda: cluster.prefill[0].received[0].closed_by_client)


async def test_push_decode_timeout_while_prefill_hangs_marks_decode_suspect(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """D's first-byte timeout fires before P's: D is closed while it waits for its KV
    (a vLLM 0.32 push leak), so its own metrics must be checked before trusting it."""
    cluster.prefill[0].behaviour.hang = True
    url, ctx = await cluster.router(
        "push",
        prefill_extra={"engine_id": "p", "kv_host": "h", "kv_port": 1},
        timeouts={"prefill": 5, "decode_first_byte": 0.4},
    )
    r = await client.post(url + "/v1/completions", json={**PROMPT, "stream": True})
    assert r.status_code == 504 and error_of(r)["code"] == "decode_first_byte_timeout"
    await eventually(lambda: cluster.decode[0].received[0].closed_by_client)
    await eventually(lambda: cluster.prefill[0].received[0].closed_by_client)
    pool = ctx.registry.get("tiny")
    assert pool is not None and pool.decode[0].suspect


async def test_leaking_decode_is_flagged_and_still_serves_as_the_last_one(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    cluster.prefill[0].behaviour.status = 500
    url, ctx = await cluster.router(
        "push",
        prefill_extra={"engine_id": "p", "kv_host": "h", "kv_port": 1},
        health_checks=True,
        admission={"max_wait": 0.3},
    )
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 502
    # The engine now reports KV held with nothing running: the leak signature.
    cluster.decode[0].behaviour.kv_usage = 0.02
    pool = ctx.registry.get("tiny")
    assert pool is not None
    await eventually(lambda: pool.decode[0].degraded)
    ready = await client.get(url + "/ready")
    assert ready.status_code == 503
    assert ready.json()["models"]["tiny"]["instances"][1]["degraded"] is True
    assert metric(ctx, "pdrouter_engine_degraded") == 1
    # The only D: leaked blocks cost capacity, not correctness; it still serves
    # (panic threshold) rather than turning the leak into an outage.
    cluster.prefill[0].behaviour.status = 200
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 200
    # Usage back to idle (e.g. engine restarted): back in rotation.
    cluster.decode[0].behaviour.kv_usage = 0.0
    await eventually(lambda: not pool.decode[0].degraded)
    assert (await client.get(url + "/ready")).status_code == 200


# -- failures after the first byte -----------------------------------------------


async def test_decode_drop_mid_stream_sends_sse_error(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    cluster.decode[0].behaviour.drop_after = 2
    url, ctx = await cluster.router("pull", retries={"max_attempts": 3})
    r = await client.post(url + "/v1/completions", json={**PROMPT, "stream": True})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert len(events) == 4  # two tokens, the error event, [DONE]; no retry after bytes went out
    assert stream_error(r.text)["code"] == "decode_unreachable"
    assert len(cluster.decode[0].received) == 1
    assert metric(ctx, "pdrouter_requests_total", outcome="upstream_error") == 1


async def test_malformed_sse_is_relayed_untouched(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    cluster.decode[0].behaviour.malformed_sse = True
    url, _ = await cluster.router("pull")
    r = await client.post(url + "/v1/completions", json={**PROMPT, "stream": True})
    assert r.status_code == 200 and "data: {not json" in r.text


# -- client disconnects ----------------------------------------------------------


async def test_disconnect_before_prefill_answers_closes_prefill(cluster: Cluster) -> None:
    cluster.prefill[0].behaviour.hang = True
    url, ctx = await cluster.router("pull")
    await client_leaves(url + "/v1/completions", PROMPT, lambda: bool(cluster.prefill[0].received))
    await eventually(lambda: cluster.prefill[0].received[0].closed_by_client)
    assert cluster.decode[0].received == []
    await eventually(
        lambda: metric(ctx, "pdrouter_client_disconnects_total", phase="before_first_byte") == 1
    )


async def test_disconnect_mid_stream_closes_decode(cluster: Cluster) -> None:
    d = cluster.decode[0].behaviour
    d.tokens, d.token_delay = 1000, 0.01
    url, ctx = await cluster.router("pull")
    await client_leaves(url + "/v1/completions", {**PROMPT, "stream": True})  # after bytes
    await eventually(lambda: cluster.decode[0].received[0].closed_by_client)
    await eventually(
        lambda: metric(ctx, "pdrouter_client_disconnects_total", phase="streaming") == 1
    )


async def test_disconnect_while_queued_takes_no_slot(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    d = cluster.decode[0].behaviour
    d.tokens, d.token_delay = 1000, 0.01
    url, ctx = await cluster.router("aggregated", decode_extra={"slots": 1})
    body = {**PROMPT, "stream": True}
    pool = ctx.registry.get("tiny")
    assert pool is not None
    # The holder keeps the only slot until the queued request has come and gone.
    holder = asyncio.create_task(client.post(url + "/v1/completions", json=body))
    await eventually(lambda: ctx.registry.slots_in_use() == 1)
    await client_leaves(url + "/v1/completions", body, lambda: pool.ledger.queue_depth == 1)
    await eventually(lambda: pool.ledger.queue_depth == 0)  # it waited in the queue, then left
    await eventually(
        lambda: metric(ctx, "pdrouter_client_disconnects_total", phase="before_first_byte") == 1
    )
    assert ctx.registry.slots_in_use() == 1 and len(cluster.decode[0].received) == 1
    holder.cancel()
    await asyncio.gather(holder, return_exceptions=True)
    await eventually(lambda: ctx.registry.slots_in_use() == 0)


# -- admission -------------------------------------------------------------------


async def test_queue_full_is_429_and_wait_timeout_is_503(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    gate = cluster.decode[0].behaviour.gate = asyncio.Event()  # the slot stays taken
    url, ctx = await cluster.router(
        "aggregated", decode_extra={"slots": 1}, admission={"queue_size": 1, "max_wait": 0.3}
    )
    pool = ctx.registry.get("tiny")
    assert pool is not None
    body = {**PROMPT, "stream": True}
    first = asyncio.create_task(client.post(url + "/v1/completions", json=body))
    await eventually(lambda: cluster.decode[0].active == 1)
    second = asyncio.create_task(client.post(url + "/v1/completions", json=body))
    await eventually(lambda: pool.ledger.queue_depth == 1)
    third = await client.post(url + "/v1/completions", json=body)
    assert third.status_code == 429 and error_of(third)["code"] == "queue_full"
    assert third.headers["retry-after"] == "1"
    r2 = await second
    assert r2.status_code == 503 and error_of(r2)["code"] == "no_capacity"
    assert int(r2.headers["retry-after"]) >= 1
    gate.set()
    assert (await first).status_code == 200
    assert len(cluster.decode[0].received) == 1  # the refused ones reached no engine


async def test_queued_request_gets_the_released_slot(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    d = cluster.decode[0].behaviour
    d.tokens, d.token_delay = 20, 0.01
    url, _ctx = await cluster.router("pull", decode_extra={"slots": 1})
    body = {**PROMPT, "stream": True}
    results = await asyncio.gather(
        *(client.post(url + "/v1/completions", json=body) for _ in range(4))
    )
    assert [r.status_code for r in results] == [200] * 4
    # Never more than one decode leg at a time on a 1-slot engine.
    legs = sorted((r.started, r.ended or 0) for r in cluster.decode[0].received)
    assert all(a[1] <= b[0] + 0.005 for a, b in itertools.pairwise(legs))


async def test_gateway_failures_eject_the_only_prefill_and_refuse_at_once(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    cluster.prefill[0].behaviour.status = 503
    url, ctx = await cluster.router("pull", breaker={"failure_threshold": 2, "open_seconds": 60})
    for _ in range(2):
        assert (await client.post(url + "/v1/completions", json=PROMPT)).status_code == 502
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 503 and error_of(r)["code"] == "no_healthy_prefill"
    assert error_of(r)["message"] == "no healthy prefill engine for model 'tiny'"
    assert 55 <= int(r.headers["retry-after"]) <= 60  # when the ejection ends
    assert len(cluster.prefill[0].received) == 2
    assert metric(ctx, "pdrouter_breaker_state", role="prefill") == 1
    assert metric(ctx, "pdrouter_decode_slots_in_use") == 0


async def test_error_answers_never_eject_the_only_prefill(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """Poisoned prompts (P answers 500 to them) with the default thresholds: each
    gets P's own error, and the clean request after them is served."""
    url, ctx = await cluster.router("pull")
    cluster.prefill[0].behaviour.status = 500
    for _ in range(3 * BreakerConfig().consecutive_5xx):
        r = await client.post(url + "/v1/completions", json=PROMPT)
        assert r.status_code == 502 and error_of(r)["code"] == 500
    cluster.prefill[0].behaviour.status = 200
    assert (await client.post(url + "/v1/completions", json=PROMPT)).status_code == 200
    assert metric(ctx, "pdrouter_breaker_state", role="prefill") == 0


async def test_error_answers_eject_a_prefill_while_another_serves(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    """With a second P in rotation, a P that answers 5xx to everything is ejected
    and clean traffic flows to the other one."""
    url, ctx = await cluster2.router(
        "pull",
        retries={"max_attempts": 2, "backoff_initial": 0},
        breaker={"consecutive_5xx": 2, "open_seconds": 60},
    )
    cluster2.prefill[0].behaviour.status = 500
    statuses = [
        (await client.post(url + "/v1/completions", json=PROMPT)).status_code for _ in range(6)
    ]
    assert statuses == [200] * 6  # each failure on P0 is retried on P1
    assert len(cluster2.prefill[0].received) == 2  # then P0 is out
    assert (
        metric(ctx, "pdrouter_breaker_state", role="prefill", engine=cluster2.prefill_urls[0]) == 1
    )


async def test_ready_reflects_health(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, _ = await cluster.router("pull", health_checks=True)
    assert (await client.get(url + "/ready")).status_code == 200
    checks = cluster.prefill[0].health_checks
    cluster.prefill[0].behaviour.health_status = 503
    # One probe more than the misses allowed (the count is in tests/unit/test_health.py).
    misses = HealthConfig().unhealthy_after
    await eventually(lambda: cluster.prefill[0].health_checks >= checks + misses + 1)
    r = await client.get(url + "/ready")
    assert r.status_code == 503 and r.json()["models"]["tiny"]["ready"] is False
    # Health checks never send a generate request to any engine.
    assert all(e.received == [] for e in cluster.engines)


async def test_push_prefill_failure_after_first_byte_ends_stream_with_error(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    fail = cluster.prefill[0].behaviour.fail_gate = asyncio.Event()
    d = cluster.decode[0].behaviour
    d.tokens, d.token_delay = 200, 0.01
    url, _ = await cluster.router(
        "push", prefill_extra={"engine_id": "p", "kv_host": "h", "kv_port": 1}
    )
    body = {**PROMPT, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = r.aiter_text()
        text = await anext(chunks)  # D's first bytes reached the client
        fail.set()  # now P fails
        text += "".join([t async for t in chunks])
    assert stream_error(text)["code"] == "500"  # P's, then [DONE] as vLLM ends a stream
    assert text.count('"text"') < d.tokens  # cut, not run to its end
    await eventually(lambda: cluster.decode[0].received[0].closed_by_client)


async def test_push_disconnect_during_prefill_lets_decode_receive_its_kv(
    cluster: Cluster,
) -> None:
    """vLLM 0.32's push connector leaks a D request closed while it waits for KV:
    after a client disconnect the router closes D only once P has written it."""
    gate = cluster.prefill[0].behaviour.gate = asyncio.Event()  # P prefills until set
    d = cluster.decode[0].behaviour
    d.tokens, d.token_delay = 1000, 0.01
    url, ctx = await cluster.router(
        "push", prefill_extra={"engine_id": "p", "kv_host": "h", "kv_port": 1}
    )
    both = lambda: bool(cluster.prefill[0].received and cluster.decode[0].received)  # noqa: E731
    await client_leaves(url + "/v1/completions", {**PROMPT, "stream": True}, both)
    (p_req,) = cluster.prefill[0].received
    (d_req,) = cluster.decode[0].received
    # The router has seen the client go (it counts the disconnect once the legs are handed
    # over): D is still open and its slot still held while P prefills.
    await eventually(
        lambda: metric(ctx, "pdrouter_client_disconnects_total", phase="before_first_byte") == 1
    )
    assert ctx.registry.slots_in_use() == 1 and d_req.ended is None and p_req.ended is None
    gate.set()
    await eventually(lambda: d_req.ended is not None)
    assert p_req.ended is not None and not p_req.closed_by_client  # P ran to completion
    assert d_req.closed_by_client and d_req.ended > p_req.ended
    await eventually(lambda: ctx.registry.slots_in_use() == 0)
    pool = ctx.registry.get("tiny")
    assert pool is not None and not pool.decode[0].suspect


async def test_stalled_stream_hits_idle_timeout(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    d = cluster.decode[0].behaviour
    d.tokens, d.token_delay = 3, 5.0
    url, _ = await cluster.router("pull", timeouts={"idle": 0.3})
    t0 = time.monotonic()
    r = await client.post(url + "/v1/completions", json={**PROMPT, "stream": True})
    assert time.monotonic() - t0 < 2.0  # the idle bound (0.3 s), not the stall (5 s)
    assert stream_error(r.text)["type"] == "timeout"
    assert stream_error(r.text)["code"] == "decode_timeout"
    await eventually(lambda: cluster.decode[0].received[0].closed_by_client)


async def test_total_timeout_bounds_a_stream(cluster: Cluster, client: httpx.AsyncClient) -> None:
    d = cluster.decode[0].behaviour
    d.tokens, d.token_delay = 1000, 0.05
    url, ctx = await cluster.router("pull", timeouts={"total": 0.5})
    r = await client.post(url + "/v1/completions", json={**PROMPT, "stream": True})
    assert stream_error(r.text)["code"] == "total_timeout"
    assert metric(ctx, "pdrouter_requests_total", outcome="timeout") == 1
    await eventually(lambda: cluster.decode[0].received[0].closed_by_client)


async def test_openapi_document_lists_the_endpoints(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await cluster.router("pull")
    doc = (await client.get(url + "/openapi.json")).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/ready"} <= set(doc["paths"])


async def test_decode_error_event_is_relayed_and_counted_as_upstream_error(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """D fails after its 200 (e.g. its KV read from a dead P): the client gets D's
    error event as is, and the router counts an upstream error, not a success."""
    cluster.decode[0].behaviour.error_event_after = 1
    url, ctx = await cluster.router("pull")
    r = await client.post(url + "/v1/completions", json={**PROMPT, "stream": True})
    assert r.status_code == 200
    assert '"KV load failed"' in r.text and r.text.endswith("data: [DONE]\n\n")
    assert metric(ctx, "pdrouter_requests_total", outcome="upstream_error") == 1
    assert metric(ctx, "pdrouter_requests_total", outcome="success") == 0


async def test_client_request_id_is_echoed_and_transitions_are_logged(
    cluster: Cluster, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    url, _ = await cluster.router("pull", breaker={"failure_threshold": 1})
    ok = await client.post(url + "/v1/completions", json=PROMPT, headers={"x-request-id": "c-1"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "c-1"
    # The router's own ids reach the engines, never the client's.
    assert all(r.request_id != "c-1" for r in cluster.prefill[0].received)
    cluster.prefill[0].behaviour.status = 503
    with caplog.at_level(logging.WARNING, logger="pd_router"):
        failed = await client.post(
            url + "/v1/completions", json=PROMPT, headers={"x-request-id": "c-2"}
        )
        refused = await client.post(
            url + "/v1/completions", json=PROMPT, headers={"x-request-id": "c-3"}
        )
    assert failed.status_code == 502 and failed.headers["x-request-id"] == "c-2"
    assert refused.status_code == 503 and refused.headers["x-request-id"] == "c-3"
    lines = [r.getMessage() for r in caplog.records]
    p_url = cluster.prefill_urls[0]
    assert any(
        ln.startswith("event=attempt_failed") and "client_id=c-2" in ln and p_url in ln
        for ln in lines
    ), lines
    assert any(ln.startswith("event=ejected") and p_url in ln for ln in lines), lines
    assert any(ln.startswith("event=rotation_out") and p_url in ln for ln in lines), lines
    assert any(
        ln.startswith("event=refused") and "client_id=c-3" in ln and "no_healthy_prefill" in ln
        for ln in lines
    ), lines
    assert p_url.removeprefix("http://") not in failed.text + refused.text


async def test_a_leaking_decode_is_out_of_rotation_while_another_serves(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await cluster2.router("pull", health_checks=True)
    pool = ctx.registry.get("tiny")
    assert pool is not None
    leaky = pool.decode[0]
    leaky.suspect_leak()
    cluster2.decode[0].behaviour.kv_usage = 0.02
    await eventually(lambda: leaky.degraded)
    for _ in range(6):
        assert (await client.post(url + "/v1/completions", json=PROMPT)).status_code == 200
    assert cluster2.decode[0].received == []
