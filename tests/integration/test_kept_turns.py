"""Kept turns in pull mode (router/pd/kept_turn_params.py) over real sockets: a finished turn's
params from D reach the conversation's next P only when the new prompt starts with the tokens
D holds, at most once and within the TTL; the client sees D's answer as an aggregated engine
gives it (no params, no token ids it did not ask for)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx
import pytest

from connector.address import NixlAddress
from router.app import create_app
from router.config import ConfigError, parse_config
from router.pd.kept_turns import keep_id
from tests.conftest import Cluster, metric
from tests.fakes.servers import serve

HISTORY = [{"role": "user", "content": "Tell me about routers. " * 8}]
REPLY = "t0 t1 t2 t3 "  # what the fake D answers with its default four tokens
KEPT_TURNS = {"model": {"kept_turns": {"enabled": True, "min_tokens": 16}}}


def _chat(messages: list[dict[str, str]], **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": messages, "max_tokens": 4, **kw}


def _next_turn(reply: str = REPLY, question: str = "And then?") -> list[dict[str, str]]:
    return [
        *HISTORY,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": question},
    ]


async def _router(cluster: Cluster, **model: Any) -> tuple[str, Any]:
    cluster.decode[0].behaviour.bidirectional = True
    cfg = {"kept_turns": {"enabled": True, "min_tokens": 16, **model}}
    return await cluster.router("pull", model=cfg)


async def _say(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], session: str = "conv-1"
) -> httpx.Response:
    r = await client.post(
        url + "/v1/chat/completions", json=body, headers={"x-session-id": session}
    )
    assert r.status_code == 200, r.text
    return r


def _last_prefill_kv(cluster: Cluster) -> dict[str, Any]:
    return cluster.prefill[0].received[-1].kv


OUTCOMES = ("success", "client_disconnect")


def _result(ctx: Any, result: str) -> float:
    return metric(ctx, "pdrouter_kept_turns_total", model="tiny", result=result)


async def test_next_turn_reads_the_kept_turn_from_d(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await _router(cluster)
    first = await _say(client, url, _chat(HISTORY))
    doc = first.json()
    # As an aggregated engine answers: no params, no token ids (the router asked for them).
    assert doc["kv_transfer_params"] is None
    assert "prompt_token_ids" not in doc and "token_ids" not in doc["choices"][0]
    assert cluster.decode[0].received[-1].body["return_token_ids"] is True
    assert _result(ctx, "kept") == 1
    assert metric(ctx, "pdrouter_kept_turns_entries", model="tiny") == 1
    kept = cluster.decode[0].received[-1]

    await _say(client, url, _chat(_next_turn()))
    kv = _last_prefill_kv(cluster)
    # P reads the history from D: D's params, not P's own empty ones.
    assert kv["do_remote_decode"] is True and kv["remote_engine_id"] == "d0-engine"
    assert kv["remote_request_id"] == f"cmpl-{kept.request_id}-0-ffff"
    assert kv["transfer_id"]  # the router's fields are kept
    assert _result(ctx, "reused") == 1
    # D's leg of the second turn carries P's params as usual.
    assert cluster.decode[0].received[-1].kv["do_remote_prefill"] is True


async def test_a_kept_turn_is_used_once(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, ctx = await _router(cluster)
    await _say(client, url, _chat(HISTORY, stream=True))  # streamed: nothing to keep
    assert _result(ctx, "kept") == 0
    await _say(client, url, _chat(HISTORY))
    await _say(client, url, _chat(_next_turn(), stream=True))  # a streamed turn can reuse
    assert _last_prefill_kv(cluster)["remote_engine_id"] == "d0-engine"
    await _say(client, url, _chat(_next_turn(), stream=True))
    assert _last_prefill_kv(cluster)["remote_block_ids"] is None  # taken already
    assert _result(ctx, "reused") == 1


async def test_an_edited_history_is_not_served_with_the_old_kv(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await _router(cluster)
    await _say(client, url, _chat(HISTORY))
    edited = [{"role": "user", "content": "Something else entirely. " * 8}]
    await _say(client, url, _chat([*edited, {"role": "user", "content": "And then?"}]))
    assert _last_prefill_kv(cluster)["remote_block_ids"] is None
    assert _result(ctx, "mismatch") == 1


async def test_a_changed_reply_reuses_the_common_prefix_blocks_only(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """The client resent another reply than D's: only the blocks of the common prefix (the
    old prompt) are read, the last one partly; P computes the rest."""
    url, ctx = await _router(cluster)
    await _say(client, url, _chat(HISTORY))
    held = cluster.decode[0].received[-1]
    prompt_len = len(f"<user>{HISTORY[0]['content']}<assistant>".encode())
    await _say(client, url, _chat(_next_turn(reply="a different reply")))
    kv = _last_prefill_kv(cluster)
    assert _result(ctx, "partial") == 1
    assert kv["remote_num_tokens"] == prompt_len
    assert kv["remote_block_ids"] == [list(range(100, 100 + -(-prompt_len // 16)))]
    assert kv["remote_request_id"] == f"cmpl-{held.request_id}-0-ffff"


async def test_a_kept_turn_expires(cluster: Cluster, client: httpx.AsyncClient) -> None:
    cluster.decode[0].behaviour.bidirectional = True
    skew = [0.0]  # the router's clock runs with time, and jumps when the test says
    model = {"kept_turns": {"enabled": True, "min_tokens": 16, "ttl_seconds": 60}}
    app = create_app(
        parse_config(cluster.config("pull", model=model)),
        health_checks=False,
        clock=lambda: time.monotonic() + skew[0],
    )
    url = await cluster.stack.enter_async_context(serve(app))
    ctx = app.state.ctx
    cluster.routers.append(ctx)
    await _say(client, url, _chat(HISTORY))
    assert _result(ctx, "kept") == 1
    skew[0] = 61.0  # past the TTL: the entry must not be handed out any more
    await _say(client, url, _chat(_next_turn()))
    assert _last_prefill_kv(cluster)["remote_block_ids"] is None
    assert _result(ctx, "expired") == 1


async def test_sessions_do_not_share_kept_turns(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await _router(cluster)
    await _say(client, url, _chat(HISTORY), session="a")
    await _say(client, url, _chat(_next_turn()), session="b")
    assert _last_prefill_kv(cluster)["remote_block_ids"] is None
    await _say(client, url, _chat(_next_turn()), session="a")
    assert _last_prefill_kv(cluster)["remote_engine_id"] == "d0-engine"


async def test_the_client_keeps_token_ids_it_asked_for(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await _router(cluster)
    doc = (await _say(client, url, _chat(HISTORY, return_token_ids=True))).json()
    assert doc["kv_transfer_params"] is None
    assert doc["choices"][0]["token_ids"] == list(REPLY.encode())
    assert doc["prompt_token_ids"]


async def test_completions_turns_too(cluster: Cluster, client: httpx.AsyncClient) -> None:
    url, ctx = await _router(cluster)
    prompt = "Once upon a time " * 4
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
    headers = {"x-session-id": "story"}
    r = await client.post(url + "/v1/completions", json=body, headers=headers)
    assert r.status_code == 200 and "prompt_token_ids" not in r.json()["choices"][0]
    text = r.json()["choices"][0]["text"]
    body["prompt"] = prompt + text + " and then"
    r = await client.post(url + "/v1/completions", json=body, headers=headers)
    assert r.status_code == 200
    assert _last_prefill_kv(cluster)["remote_engine_id"] == "d0-engine"
    assert _result(ctx, "reused") == 1


async def test_a_failed_read_from_d_costs_a_recompute_not_the_request(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, _ = await _router(cluster)
    await _say(client, url, _chat(HISTORY))
    cluster.prefill[0].behaviour.fail_kv_read = True
    await _say(client, url, _chat(_next_turn()))
    tried, retried = (r.kv for r in cluster.prefill[0].received[-2:])
    assert tried["remote_engine_id"] == "d0-engine" and retried["remote_block_ids"] is None


async def test_without_bidirectional_engines_nothing_is_kept_and_ids_stay_hidden(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await cluster.router("pull", **KEPT_TURNS)  # D returns no params
    doc = (await _say(client, url, _chat(HISTORY))).json()
    assert "prompt_token_ids" not in doc and "token_ids" not in doc["choices"][0]
    assert _result(ctx, "kept") == 0


async def test_without_a_session_nothing_is_kept(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await _router(cluster)
    r = await client.post(url + "/v1/chat/completions", json=_chat(HISTORY))
    assert r.status_code == 200
    assert "return_token_ids" not in cluster.decode[0].received[-1].body
    assert _result(ctx, "kept") == 0


@pytest.mark.parametrize("mode", ["push", "push-sequential", "aggregated"])
def test_kept_turns_is_a_pull_or_pipelined_mode_setting(cluster: Cluster, mode: str) -> None:
    cfg = cluster.config(mode, **KEPT_TURNS)
    with pytest.raises(ConfigError, match="kept_turns needs mode 'pull' or 'pipelined'"):
        create_app(parse_config(cfg))


# -- pipelined: this project's connector keeps the turn; P checks it itself --------------------


# Pipelined mode with kept_turns on: the engines' NIXL identities as the router needs them.
PIPELINED: dict[str, Any] = {
    "prefill_extra": {"engine_id": "P", "kv_host": "10.0.0.1", "kv_port": 7001},
    "decode_extra": {"engine_id": "D", "kv_host": "10.0.0.2", "kv_port": 7002},
}


async def _pipelined(cluster: Cluster, **model: Any) -> tuple[str, Any]:
    cfg = {"kept_turns": {"enabled": True, **model}}
    return await cluster.router("pipelined", model=cfg, **PIPELINED)


def _pipelined_app(cluster: Cluster) -> Any:
    """The router app itself, for a test that wraps it in an ASGI spy."""
    cfg = cluster.config("pipelined", model={"kept_turns": {"enabled": True}}, **PIPELINED)
    return create_app(parse_config(cfg))


async def _stream(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], session: str | None
) -> str:
    headers = {"x-session-id": session} if session else {}
    body = _chat(messages, stream=True)
    r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    return r.text


async def test_pipelined_streamed_turns_hand_p_the_previous_turn_kept_on_d(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await _pipelined(cluster)
    kid = keep_id("tiny", "anonymous", "conv-1")
    await _stream(client, url, HISTORY, "conv-1")
    (p1,), (d1,) = cluster.prefill[0].received, cluster.decode[0].received
    # D keeps the turn under the conversation's keep id; a first turn has nothing to read.
    assert d1.kv["keep_turn"] == kid and "read_kept_turn" not in p1.kv
    assert _result(ctx, "kept") == 1

    await _stream(client, url, _next_turn(), "conv-1")
    p2, d2 = cluster.prefill[0].received[-1], cluster.decode[0].received[-1]
    # P is told where the last turn is kept: the keep id and D's NIXL address.
    assert p2.kv["read_kept_turn"] == {
        "transfer_id": kid,
        "remote_engine_id": "D",
        "remote_host": "10.0.0.2",
        "remote_port": 7002,
    }
    assert p2.kv["transfer_id"] == d2.kv["transfer_id"] != d1.kv["transfer_id"]
    assert d2.kv["keep_turn"] == kid  # replaces the first turn on D
    assert _result(ctx, "offered") == 1
    assert keep_id("tiny", "other-key", "conv-1") != kid != keep_id("tiny", "anonymous", "c2")


async def test_pipelined_kept_turn_is_not_offered_between_unequal_tp_sizes(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """The connector reads a kept turn only between P and D of one tensor-parallel size: with
    P at TP 2 and D at TP 1 the router does not offer it (P would decline it anyway) and
    counts why; D still keeps each turn, for a P of its size."""
    sizes = {
        "prefill_extra": {**PIPELINED["prefill_extra"], "tp_size": 2},
        "decode_extra": PIPELINED["decode_extra"],
    }
    url, ctx = await cluster.router("pipelined", model={"kept_turns": {"enabled": True}}, **sizes)
    await _stream(client, url, HISTORY, "conv-1")
    await _stream(client, url, _next_turn(), "conv-1")
    p2, d2 = cluster.prefill[0].received[-1], cluster.decode[0].received[-1]
    assert "read_kept_turn" not in p2.kv and d2.kv["keep_turn"]
    assert _result(ctx, "unequal_tp") == 1 and _result(ctx, "offered") == 0


async def test_pipelined_turn_is_kept_before_the_client_sees_its_end(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """A client sends its next turn as soon as the last one ends: the kept turn must be
    recorded by the time the router sends the answer's last bytes, streamed or not (not when
    it closes D's leg afterwards, which races the next turn)."""
    app = _pipelined_app(cluster)
    kept_at_end: list[float] = []

    async def spy(scope: Any, receive: Any, send: Any) -> None:
        async def watch(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                kept_at_end.append(_result(app.state.ctx, "kept"))
            await send(message)

        await app(scope, receive, watch)

    url = await cluster.stack.enter_async_context(serve(spy))
    headers = {"x-session-id": "conv-1"}
    for body in (_chat(HISTORY, stream=True), _chat(HISTORY)):
        r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200
    assert kept_at_end == [1, 2]


async def test_pipelined_turn_is_kept_before_the_client_reads_done(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """A streaming client stops at D's ``[DONE]`` event and closes, without waiting for the
    HTTP end, which may come in a read of its own: the turn must be kept before ``[DONE]``
    leaves, and the request is a success, not a disconnect. D holds its end here; the
    router holds ``[DONE]`` for it."""
    app = _pipelined_app(cluster)
    ctx = app.state.ctx
    kept_at_done: list[float] = []
    done_sent = asyncio.Event()

    async def spy(scope: Any, receive: Any, send: Any) -> None:
        async def watch(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and b"[DONE]" in message["body"]:
                kept_at_done.append(_result(ctx, "kept"))
                done_sent.set()
            await send(message)

        await app(scope, receive, watch)

    async def until_done() -> None:  # as the openai SDK reads a stream
        body, headers = _chat(HISTORY, stream=True), {"x-session-id": "conv-1"}
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body, headers=headers
        ) as r:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    break

    url = await cluster.stack.enter_async_context(serve(spy))
    d = cluster.decode[0]
    d.behaviour.end_gate = end = asyncio.Event()
    turn = asyncio.create_task(until_done())
    await d.holding_end.wait()
    # Correct: nothing comes while D holds its end. A router that sent [DONE] on does so
    # within milliseconds, with the turn not yet kept (0 in kept_at_done).
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done_sent.wait(), 0.5)
    end.set()
    await turn
    assert kept_at_done == [1]
    # The router counts the request just after its last bytes: wait for the count, if slow.
    for _ in range(200):
        outcomes = {o: metric(ctx, "pdrouter_requests_total", outcome=o) for o in OUTCOMES}
        if any(outcomes.values()):
            break
        await asyncio.sleep(0.01)
    assert outcomes == {"success": 1, "client_disconnect": 0}


async def test_pipelined_requests_without_a_session_keep_nothing(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await _pipelined(cluster)
    await _stream(client, url, HISTORY, None)
    await _stream(client, url, _next_turn(), None)
    assert all("keep_turn" not in r.kv for r in cluster.decode[0].received)
    assert all("read_kept_turn" not in r.kv for r in cluster.prefill[0].received)
    assert _result(ctx, "kept") == 0


async def test_pipelined_keeps_no_turn_whose_stream_broke(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await _pipelined(cluster)
    cluster.decode[0].behaviour.drop_after = 2  # D's stream ends mid-answer
    r = await client.post(
        url + "/v1/chat/completions",
        json=_chat(HISTORY, stream=True),
        headers={"x-session-id": "conv-1"},
    )
    assert r.status_code == 200 and '"error"' in r.text  # the cut stream, reported in-band
    cluster.decode[0].behaviour.drop_after = None
    await _stream(client, url, _next_turn(), "conv-1")
    # The router keeps no table: P is pointed at D, which kept nothing under the id and
    # refuses at once (connector/kept_turns_worker.py); P computes everything.
    assert cluster.prefill[0].received[-1].kv["read_kept_turn"]["transfer_id"] == keep_id(
        "tiny", "anonymous", "conv-1"
    )
    assert _result(ctx, "kept") == 1  # the second turn only


async def test_pipelined_names_the_current_engine_of_a_restarted_d(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    url, ctx = await _pipelined(cluster, ttl_seconds=60)
    await _stream(client, url, HISTORY, "conv-1")
    pool = ctx.registry.get("tiny")
    # D restarted under a new engine id (as a reload would configure it): its KV is gone,
    # and the new engine, which keeps nothing under the id, refuses P's question at once.
    pool.decode[0].configure_nixl(NixlAddress("D-2", "10.0.0.2", 7002), None)
    await _stream(client, url, _next_turn(), "conv-1")
    p2 = cluster.prefill[0].received[-1].kv
    assert p2["read_kept_turn"]["remote_engine_id"] == p2["remote_engine_id"] == "D-2"


async def test_pipelined_any_replica_offers_the_turn_another_one_kept(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    """Two replicas, no KV events: consecutive turns go to different replicas, and each turn's
    P is pointed at the D that kept the previous one (both replicas place a session on the same
    D, by rendezvous over the load the engines report)."""
    cfg = cluster2.config(
        "pipelined", model={"kept_turns": {"enabled": True}}, admission={"replicas": 2}
    )
    model = cfg["models"][0]
    for i, inst in enumerate([*model["prefill"], *model["decode"]]):
        inst |= {"engine_id": f"E{i}", "kv_host": f"10.0.0.{i}", "kv_port": 7000 + i}
    urls = []
    for _ in range(2):
        app = create_app(parse_config(cfg), health_checks=False)
        urls.append(await cluster2.stack.enter_async_context(serve(app)))
        cluster2.routers.append(app.state.ctx)
    for conv in range(4):
        session = f"conv-{conv}"
        messages = [{"role": "user", "content": f"{conv}: " + "Tell me about routers. " * 8}]
        kept_by = None
        for turn in range(4):
            await _stream(client, urls[(conv + turn) % 2], messages, session)
            p = next(
                r
                for e in cluster2.prefill
                for r in e.received
                if r.kv.get("transfer_id") and str(messages[-1]) in str(r.body)
            )
            d = next(
                r
                for e in cluster2.decode
                for r in e.received
                if r.kv.get("transfer_id") == p.kv["transfer_id"]
            )
            if kept_by is not None:
                assert p.kv["read_kept_turn"] == {
                    "transfer_id": keep_id("tiny", "anonymous", session),
                    **kept_by,
                }
            assert d.kv["keep_turn"] == keep_id("tiny", "anonymous", session)
            kept_by = {k: p.kv[k] for k in ("remote_engine_id", "remote_host", "remote_port")}
            messages += [
                {"role": "assistant", "content": REPLY},
                {"role": "user", "content": f"And then {turn} in {conv}?"},
            ]
