"""OpenTelemetry traces, exported over real OTLP/HTTP to a receiver that decodes them."""

from __future__ import annotations

import json

import httpx
import pytest

from router.config import TracingConfig
from router.tracing import Tracing
from tests.conftest import Cluster, client_leaves, eventually
from tests.fakes.otlp import OtlpReceiver, ReceivedSpan
from tests.fakes.servers import serve

PROMPT = {"model": "tiny", "prompt": "hello there", "max_tokens": 3, "stream": True}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"


async def traced_router(
    cluster: Cluster, mode: str, **overrides: object
) -> tuple[str, OtlpReceiver]:
    receiver = OtlpReceiver()
    otlp = await cluster.stack.enter_async_context(serve(receiver))
    url, _ = await cluster.router(mode, tracing={"endpoint": otlp + "/v1/traces"}, **overrides)
    return url, receiver


def request_span(receiver: OtlpReceiver) -> ReceivedSpan:
    (span,) = [s for s in receiver.spans if s.kind == 2]  # SERVER
    return span


def children(receiver: OtlpReceiver, parent: ReceivedSpan) -> dict[str, ReceivedSpan]:
    return {s.name: s for s in receiver.spans if s.parent_id == parent.span_id}


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_one_trace_across_router_and_both_legs(
    cluster: Cluster, client: httpx.AsyncClient, mode: str
) -> None:
    url, receiver = await traced_router(cluster, mode)
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"
    r = await client.post(
        url + "/v1/completions", json=PROMPT, headers={"traceparent": traceparent}
    )
    assert r.status_code == 200
    await eventually(lambda: any(s.kind == 2 for s in receiver.spans), timeout=10)
    await eventually(lambda: len(receiver.spans) >= 6, timeout=10)
    root = request_span(receiver)
    assert root.name == "POST /v1/completions" and root.service == "pd-router"
    assert root.trace_id == CLIENT_TRACE and root.parent_id == CLIENT_PARENT  # the client's
    assert root.attributes["pdrouter.decision"] == mode
    assert root.attributes["pdrouter.outcome"] == "success"
    assert (
        root.attributes["gen_ai.request.model"] == "tiny" and root.attributes["pdrouter.ttft_s"] > 0
    )
    top = children(receiver, root)
    assert set(top) == {"attempt", "stream"}
    attempt = top["attempt"]
    legs = children(receiver, attempt)
    assert set(legs) == {"slot_wait", "prefill", "decode_first_byte"}
    assert attempt.attributes["pdrouter.prefill"] == cluster.prefill_urls[0]
    assert attempt.attributes["pdrouter.decode"] == cluster.decode_urls[0]
    assert attempt.attributes["pdrouter.transfer_id"].startswith("xfer-")
    assert {s.trace_id for s in receiver.spans} == {CLIENT_TRACE}
    # Each engine leg names its own span as parent: the engines' spans join this trace.
    (p_leg,), (d_leg,) = cluster.prefill[0].received, cluster.decode[0].received
    assert p_leg.headers["traceparent"] == f"00-{CLIENT_TRACE}-{legs['prefill'].span_id}-01"
    d_parent = legs["decode_first_byte"].span_id
    assert d_leg.headers["traceparent"] == f"00-{CLIENT_TRACE}-{d_parent}-01"


async def test_retry_gives_two_attempts(cluster2: Cluster, client: httpx.AsyncClient) -> None:
    cluster2.decode[0].behaviour.status = 503
    cluster2.decode[1].behaviour.status = 503
    url, receiver = await traced_router(cluster2, "pull", retries={"max_attempts": 2})
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 502
    await eventually(lambda: any(s.kind == 2 for s in receiver.spans), timeout=10)
    root = request_span(receiver)
    await eventually(lambda: len(receiver.named("attempt")) == 2, timeout=10)
    attempts = receiver.named("attempt")
    assert all(a.parent_id == root.span_id and a.status == 2 for a in attempts)
    assert sorted(a.attributes["pdrouter.attempt"] for a in attempts) == [1, 2]
    assert root.attributes["pdrouter.retries"] == 1
    assert root.status == 2 and root.attributes["pdrouter.outcome"] == "upstream_error"


async def test_prefill_failure_is_an_error_span(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    cluster.prefill[0].behaviour.status = 500
    url, receiver = await traced_router(cluster, "pull")
    r = await client.post(url + "/v1/completions", json=PROMPT)
    assert r.status_code == 502
    await eventually(lambda: any(s.kind == 2 for s in receiver.spans), timeout=10)
    await eventually(lambda: bool(receiver.named("prefill")), timeout=10)
    (prefill,) = receiver.named("prefill")
    assert prefill.status == 2
    assert not receiver.named("decode_first_byte")  # D was never asked
    assert request_span(receiver).attributes["pdrouter.outcome"] == "upstream_error"


async def test_client_disconnect_is_recorded(cluster: Cluster, client: httpx.AsyncClient) -> None:
    d = cluster.decode[0].behaviour
    d.tokens, d.token_delay = 500, 0.01
    url, receiver = await traced_router(cluster, "push")
    await client_leaves(url + "/v1/completions", PROMPT)  # once the first bytes came
    await eventually(lambda: any(s.kind == 2 for s in receiver.spans), timeout=10)
    root = request_span(receiver)
    assert root.attributes["pdrouter.outcome"] == "client_disconnect" and root.status == 2
    await eventually(lambda: bool(receiver.named("stream")), timeout=10)


async def test_off_by_default_sends_no_traceparent(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    assert not Tracing(TracingConfig()).enabled
    url, _ = await cluster.router("pull")
    r = await client.post(url + "/v1/completions", json={**PROMPT, "stream": False})
    assert r.status_code == 200 and json.loads(r.text)["choices"]
    assert all("traceparent" not in rec.headers for e in cluster.engines for rec in e.received)
