"""The adaptive rule (models[].adaptive) over fake engines on real sockets: which engine gets
a request, with which body, what is held meanwhile and what is counted.

Each test first sends one streamed request, which the rule sends through P/D (no timings
yet) and which teaches it the model's prefill and step times; the test then sets the load it
means (a request held at an engine) before the request it judges.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest

from router.access_log import ACCESS_LOGGER
from router.app import AppContext
from router.engines.instance import Instance
from router.engines.timings import Timings
from tests.conftest import Cluster, client_leaves, eventually, metric
from tests.integration.test_modes import sse_payloads

STREAM = {"model": "tiny", "prompt": "hello there", "max_tokens": 8, "stream": True}


def _adaptive(**settings: Any) -> dict[str, Any]:
    return {"adaptive": {"enabled": True, **settings}}


def _choices(ctx: AppContext) -> dict[str, float]:
    return {
        c: metric(ctx, "pdrouter_route_choice_total", choice=c)
        for c in ("pd", "decode_alone", "prefill_alone")
    }


def _engines(ctx: AppContext) -> tuple[Instance, Instance]:
    pool = ctx.registry.get("tiny")
    assert pool is not None
    return pool.prefill[0], pool.decode[0]


def _idle(inst: Instance) -> bool:
    return inst.slots_held == inst.legs_running == inst.prefilling == inst.at_engine == 0


async def _learn(cluster: Cluster, client: httpx.AsyncClient, url: str) -> None:
    """One request through P/D: the rule's timings. D spaces its tokens so that its stream
    comes in several reads (a step time needs two)."""
    cluster.decode[0].behaviour.token_delay = 0.002
    r = await client.post(url + "/v1/completions", json=STREAM)
    cluster.decode[0].behaviour.token_delay = 0.0
    assert r.status_code == 200 and sse_payloads(r.text)[-1] == "[DONE]"
    assert "kv_transfer_params" in cluster.decode[0].received[-1].body
    assert len(cluster.prefill[0].received) == 1


async def test_an_idle_request_is_served_by_d_alone_without_kv_params(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await cluster.router("pull", model=_adaptive())
    await _learn(cluster, client, url)
    r = await client.post(url + "/v1/completions", json=STREAM)
    assert r.status_code == 200
    assert sse_payloads(r.text)[-1] == "[DONE]"
    assert len(cluster.prefill[0].received) == 1  # P saw only the first request
    alone = cluster.decode[0].received[-1]
    assert "kv_transfer_params" not in alone.body
    assert alone.body["max_tokens"] == 8 and alone.body["stream"] is True
    assert _choices(ctx) == {"pd": 1, "decode_alone": 1, "prefill_alone": 0}
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision="decode_alone") == 1
    assert all(_idle(i) for i in _engines(ctx))


async def test_p_alone_serves_the_whole_request_and_holds_no_decode_slot(
    cluster: Cluster, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    url, ctx = await cluster.router(
        "pull", model=_adaptive(single_engine="prefill"), logging={"access": True}
    )
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    p, d = _engines(ctx)
    await _learn(cluster, client, url)
    gate = cluster.prefill[0].behaviour.gate = asyncio.Event()
    answer = asyncio.create_task(client.post(url + "/v1/completions", json=STREAM))
    try:
        await eventually(lambda: len(cluster.prefill[0].received) == 2)
        # P computes the prompt; D holds nothing for it.
        assert (p.prefilling, p.load, d.slots_held) == (1, 1, 0)
        gate.set()
        r = await answer
    finally:
        gate.set()
        await asyncio.gather(answer, return_exceptions=True)
    assert r.status_code == 200
    events = sse_payloads(r.text)
    assert events[-1] == "[DONE]" and len(events) == 5  # P's 4 tokens, whole
    alone = cluster.prefill[0].received[-1]
    assert "kv_transfer_params" not in alone.body and alone.body["max_tokens"] == 8
    assert len(cluster.decode[0].received) == 1  # D saw only the first request
    assert _choices(ctx) == {"pd": 1, "decode_alone": 0, "prefill_alone": 1}
    assert _idle(p) and _idle(d)
    # The access line names P, and no D, for the request P served alone.
    *_, line = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]
    fields = dict(pair.split("=", 1) for pair in line.split(" "))
    assert (fields["decision"], fields["prefill"], fields["decode"]) == (
        "prefill_alone",
        cluster.prefill_urls[0],
        "-",
    )


async def test_a_prompt_pending_on_p_sends_the_next_request_through_p_d(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """Load on P: a request P serves alone is still before its first bytes, so the next one
    goes through P/D (its P leg queues behind, its D leg takes the KV)."""
    url, ctx = await cluster.router("pull", model=_adaptive(single_engine="prefill"))
    p, d = _engines(ctx)
    await _learn(cluster, client, url)
    gate = cluster.prefill[0].behaviour.gate = asyncio.Event()
    first = asyncio.create_task(client.post(url + "/v1/completions", json=STREAM))
    second = None
    try:
        await eventually(lambda: p.prefilling == 1)
        second = asyncio.create_task(client.post(url + "/v1/completions", json=STREAM))
        await eventually(lambda: p.legs_running == 1)
        gate.set()
        answers = await asyncio.gather(first, second)
    finally:
        gate.set()
        await asyncio.gather(*(t for t in (first, second) if t), return_exceptions=True)
    assert [a.status_code for a in answers] == [200, 200]
    assert _choices(ctx) == {"pd": 2, "decode_alone": 0, "prefill_alone": 1}
    p_leg = cluster.prefill[0].received[-1]
    assert p_leg.body["max_tokens"] == 1 and p_leg.kv["do_remote_decode"] is True
    assert "kv_transfer_params" in cluster.decode[0].received[-1].body
    assert _idle(p) and _idle(d)


async def test_a_stream_on_d_whose_tpot_a_local_prefill_would_break_sends_p_d(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """The same config serves an idle request by D alone, and the next one, while D decodes
    that stream, through P/D: with a TPOT target no stall fits, only D's streams decide."""
    settings = _adaptive(single_engine="decode", tpot_ms=0.001, ttft_ms=60_000)
    url, ctx = await cluster.router("pull", model=settings)
    p, d = _engines(ctx)
    await _learn(cluster, client, url)
    held = asyncio.Event()
    holds = [held]
    cluster.decode[0].hold_done = lambda rec: holds.pop() if holds else None
    streaming = asyncio.create_task(client.post(url + "/v1/completions", json=STREAM))
    try:
        await eventually(lambda: d.at_engine == 1)  # its first bytes are in: D decodes it
        r = await client.post(url + "/v1/completions", json=STREAM)
        assert r.status_code == 200 and sse_payloads(r.text)[-1] == "[DONE]"
        held.set()
        assert (await streaming).status_code == 200
    finally:
        held.set()
        await asyncio.gather(streaming, return_exceptions=True)
    alone, split = cluster.decode[0].received[-2:]
    assert "kv_transfer_params" not in alone.body
    assert split.kv["remote_block_ids"] and len(cluster.prefill[0].received) == 2
    assert _choices(ctx) == {"pd": 2, "decode_alone": 1, "prefill_alone": 0}
    assert _idle(p) and _idle(d)


async def test_p_alone_failures_and_disconnects_release_everything(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await cluster.router("pull", model=_adaptive(single_engine="prefill"))
    p, d = _engines(ctx)
    await _learn(cluster, client, url)
    cluster.prefill[0].behaviour.status = 500
    r = await client.post(url + "/v1/completions", json=STREAM)
    assert r.status_code == 502, r.text
    assert metric(ctx, "pdrouter_upstream_errors_total", role="prefill", code="500") == 1
    assert _idle(p) and _idle(d)
    cluster.prefill[0].behaviour.status = 200
    held = asyncio.Event()  # P's stream stays open until the client has left
    cluster.prefill[0].hold_done = lambda rec: held
    try:
        await client_leaves(url + "/v1/completions", STREAM, when=lambda: p.at_engine == 1)
        await eventually(lambda: _idle(p) and cluster.prefill[0].active == 0)
    finally:
        held.set()
    assert _idle(d) and _choices(ctx)["prefill_alone"] == 2


async def test_off_by_default_every_request_goes_through_p_d(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await cluster.router("pull")
    for _ in range(2):
        await _learn_no_check(client, url)
    assert len(cluster.prefill[0].received) == 2
    assert all("kv_transfer_params" in r.body for r in cluster.decode[0].received)
    assert metric(ctx, "pdrouter_route_choice_total") == 0
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision="pull") == 2


async def _learn_no_check(client: httpx.AsyncClient, url: str) -> None:
    r = await client.post(url + "/v1/completions", json=STREAM)
    assert r.status_code == 200


async def test_only_a_prompt_sent_to_an_engine_computing_nothing_teaches_the_prefill_time(
    cluster: Cluster, client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule multiplies the prefill time by the prompts queued: a P leg sent while P
    computes another prompt waits behind it, and its time (the wait included) is not taught."""
    taught: list[int] = []
    teach = Timings.observe_prefill

    def spy(self: Timings, seconds: float, prompt_tokens: int) -> None:
        taught.append(prompt_tokens)
        teach(self, seconds, prompt_tokens)

    monkeypatch.setattr(Timings, "observe_prefill", spy)
    url, ctx = await cluster.router("pull")
    p, d = _engines(ctx)
    gate = cluster.prefill[0].behaviour.gate = asyncio.Event()
    first = asyncio.create_task(client.post(url + "/v1/completions", json=STREAM))
    second = None
    try:
        await eventually(lambda: p.legs_running == 1)
        second = asyncio.create_task(client.post(url + "/v1/completions", json=STREAM))
        await eventually(lambda: p.legs_running == 2)
        gate.set()
        answers = await asyncio.gather(first, second)
    finally:
        gate.set()
        await asyncio.gather(*(t for t in (first, second) if t), return_exceptions=True)
    assert [a.status_code for a in answers] == [200, 200]
    assert len(taught) == 1  # the first leg only
    assert _idle(p) and _idle(d)
