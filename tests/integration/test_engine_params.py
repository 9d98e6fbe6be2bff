"""vLLM 0.33+'s answers through the router (fake engines speaking that wire): no engine
coordinates reach a client, in any mode, streamed or not, kept turns on or off, and every
other byte is the engine's own; a paused engine's 503 is load, not a fault."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from router.engines.breaker import BreakerState
from tests.conftest import Cluster, eventually, metric
from tests.fakes.fake_vllm import _token_ids as _fake_prompt_ids

# What an engine of another connector might answer with: coordinates a client must not see.
D_COORDS = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[41, 42, 43]],
    "remote_engine_id": "d-secret-engine",
    "remote_request_id": "cmpl-secret-0",
    "remote_host": "10.66.0.7",
    "remote_port": 5777,
    "tp_size": 1,
}
IDS = {"engine_id": "e", "kv_host": "127.0.0.1", "kv_port": 5600}
HISTORY = [{"role": "user", "content": "Tell me about routers. " * 8}]
_VALUE = re.compile(rb'"kv_transfer_params"\s*:\s*(.)')


def _no_coordinates(content: bytes) -> None:
    """Every ``kv_transfer_params`` the client got is null, and nothing names a remote."""
    assert all(v == b"n" for v in _VALUE.findall(content)), content[-400:]
    for secret in (b"remote_", b"secret", b"10.66.0.7", b"d0-engine"):
        assert secret not in content, content[-400:]


async def _router(cluster: Cluster, mode: str, **overrides: Any) -> str:
    for engine in cluster.engines:
        engine.behaviour.wire = "0.33"
        engine.behaviour.version = "0.33.0"
    cluster.decode[0].behaviour.own_params = D_COORDS
    url, ctx = await cluster.router(mode, prefill_extra=IDS, decode_extra=IDS, **overrides)
    if overrides.get("health_checks"):  # the engines' versions read before any request
        await eventually(lambda: all(i.facts.version for i in ctx.registry.instances()))
    return url


async def _engines_own(client: httpx.AsyncClient, url: str, rec: Any) -> bytes:
    """The engine's answer to the very request the router sent it (same body and id)."""
    headers = {"x-request-id": rec.request_id}
    async with client.stream("POST", url + rec.path, json=rec.body, headers=headers) as r:
        assert r.status_code == 200
        return b"".join([chunk async for chunk in r.aiter_raw()])


def _nulled(content: bytes, params: dict[str, Any]) -> bytes:
    """``content`` as an aggregated engine sends it: the fake writes its JSON with
    ``json.dumps``, so its params are these bytes."""
    raw = json.dumps(params).encode()
    assert raw in content  # the engine did send coordinates: the test is not vacuous
    return content.replace(raw, b"null")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("mode", ["pull", "push", "push-sequential", "pipelined", "aggregated"])
async def test_no_engine_coordinates_reach_a_client(
    cluster: Cluster, client: httpx.AsyncClient, mode: str, stream: bool
) -> None:
    url = await _router(cluster, mode)
    for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4}),
        ("/v1/chat/completions", {"model": "tiny", "messages": HISTORY, "max_tokens": 4}),
    ):
        r = await client.post(url + path, json={**body, "stream": stream})
        assert r.status_code == 200, r.text
        _no_coordinates(r.content)
        own = await _engines_own(client, cluster.decode_urls[0], cluster.decode[0].received[-1])
        assert r.content == _nulled(own, D_COORDS)  # every other byte is the engine's


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_several_prompts_merged_carry_no_coordinates(
    cluster: Cluster, client: httpx.AsyncClient, stream: bool
) -> None:
    url = await _router(cluster, "pull")
    body = {"model": "tiny", "prompt": ["one", "two"], "max_tokens": 3, "stream": stream}
    r = await client.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    _no_coordinates(r.content)
    assert r.content.count(b"t2 ") == 2  # both prompts' answers are there


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_kept_turns_on_a_033_d_show_the_client_nothing_of_d(
    cluster: Cluster, client: httpx.AsyncClient, stream: bool
) -> None:
    """A bidirectional pull D names the blocks it keeps on every answer's end (vLLM 0.33+):
    the client sees null; the turn is kept for the next, streamed too (its prompt's ids from
    P, D's params from its stream's last chunk)."""
    kept = {"kept_turns": {"enabled": True, "min_tokens": 16}}
    url = await _router(cluster, "pull", model=kept, health_checks=True)
    cluster.decode[0].behaviour.own_params = None
    cluster.decode[0].behaviour.bidirectional = True
    headers = {"x-session-id": "conv-1"}
    body = {"model": "tiny", "messages": HISTORY, "max_tokens": 4, "stream": stream}
    r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    _no_coordinates(r.content)
    d_req = cluster.decode[0].received[-1]
    own = await _engines_own(client, cluster.decode_urls[0], d_req)
    if stream:
        params = json.loads(own.split(b"\n\n")[-3].removeprefix(b"data: "))["kv_transfer_params"]
        assert params["remote_engine_id"] == "d0-engine"
        assert r.content == _nulled(own, params)
    else:
        # Asked for token ids to keep the turn: the client gets D's answer without them.
        doc = json.loads(own)
        assert doc["kv_transfer_params"]["remote_engine_id"] == "d0-engine"
        doc["kv_transfer_params"] = None
        del doc["prompt_token_ids"], doc["choices"][0]["token_ids"]
        assert r.json() == doc
    follow = [*HISTORY, {"role": "assistant", "content": "t0 t1 t2 t3 "}]
    body["messages"] = [*follow, {"role": "user", "content": "And then?"}]
    r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200
    _no_coordinates(r.content)
    first_p, next_p = [x for x in cluster.prefill[0].received if x.path != "/tokenize"]
    assert next_p.kv.get("remote_engine_id") == "d0-engine"  # the turn was kept and is read
    assert first_p.body.get("return_token_ids") is (True if stream else None)
    if stream:  # at most the prompt's blocks: the stream told the router no reply's ids
        prompt_len = len(_fake_prompt_ids(first_p.body))
        assert 16 <= next_p.kv["remote_num_tokens"] <= prompt_len
        assert len(next_p.kv["remote_block_ids"][0]) == -(-next_p.kv["remote_num_tokens"] // 16)


# -- a paused engine ------------------------------------------------------------------------

PROMPT = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


async def test_a_paused_engine_s_503_reaches_the_client_as_is_and_ejects_nothing(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """One ordinary 503 ejects P here (``failure_threshold: 1``); a paused P's do not."""
    url, ctx = await cluster.router("pull", breaker={"failure_threshold": 1, "open_seconds": 60})
    p = cluster.prefill[0]
    p.behaviour.paused = True
    for _ in range(3):
        r = await client.post(url + "/v1/completions", json=PROMPT)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "ServiceUnavailableError"  # vLLM's body
    (inst,) = (i for i in ctx.registry.instances() if i.url == cluster.prefill_urls[0])
    assert inst.breaker.state is BreakerState.CLOSED
    assert metric(ctx, "pdrouter_requests_total", outcome="no_capacity") == 3
    p.behaviour.paused = False
    assert (await client.post(url + "/v1/completions", json=PROMPT)).status_code == 200
    # Any other 503 is a fault: P is out of rotation after it.
    p.behaviour.status = 503
    assert (await client.post(url + "/v1/completions", json=PROMPT)).status_code == 502
    p.behaviour.status = 200
    refused = await client.post(url + "/v1/completions", json=PROMPT)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_healthy_prefill"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_requests_to_a_paused_engine_go_to_another(
    cluster2: Cluster, client: httpx.AsyncClient, role: str, stream: bool
) -> None:
    url, ctx = await cluster2.router(
        "pull",
        retries={"max_attempts": 2, "backoff_initial": 0},
        breaker={"failure_threshold": 1, "consecutive_5xx": 1, "open_seconds": 60},
    )
    engines, urls = (
        (cluster2.prefill, cluster2.prefill_urls)
        if role == "prefill"
        else (cluster2.decode, cluster2.decode_urls)
    )
    paused = engines[0]
    paused.behaviour.paused = True
    for _ in range(6):
        r = await client.post(url + "/v1/completions", json={**PROMPT, "stream": stream})
        assert r.status_code == 200 and b"t3 " in r.content, r.text
        assert b"paused" not in r.content
    assert len(paused.received) >= 2  # tried, refused, and tried again later: still in rotation
    inst = next(i for i in ctx.registry.instances() if i.url == urls[0])
    assert inst.breaker.state is BreakerState.CLOSED
