"""Mid-stream migration (issue 40) on deterministic fake engines.

Each fake D is a deterministic model (each next token a function of the whole sequence), so a
request continued from any cut gives the uninterrupted answer. A D is told to fail after
exactly ``K`` streamed tokens: its connection dropped, its error event, its response ended
before ``[DONE]``, or a stall on an event the test holds (the router's ``stall_timeout`` then
ends it). Which D the first request reaches is the policy's: both Ds carry the fault behind one
:class:`Shot`, so the first stream is cut wherever it runs and its continuation, which avoids
that D, runs whole. The cluster fixture asserts every slot free and every upstream connection
closed after each test.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.access_log import ACCESS_LOGGER
from router.engines.breaker import BreakerState
from router.errors import Fault
from tests.conftest import Cluster, client_leaves, eventually, metric, stream_error
from tests.fakes.fake_vllm import FakeEngine, Shot, deterministic_reply, prompt_ids

N = 12  # tokens asked for
K = 5  # tokens streamed before a cut
COMPLETION = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": N, "stream": True}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "tell me a story"}],
    "max_tokens": N,
    "stream": True,
}
PATHS = {"completions": ("/v1/completions", COMPLETION), "chat": ("/v1/chat/completions", CHAT)}
# The fault behind each cause, as Behaviour fields set to K.
FAULTS = {"drop": "drop_after", "error_event": "error_event_after", "end": "end_after"}
CAUSES = {"drop": "disconnect", "error_event": "error_event", "end": "disconnect"}


@pytest.fixture
async def stall() -> AsyncIterator[asyncio.Event]:
    """The event a stalled fake D waits on: held by the test, set at its end."""
    gate = asyncio.Event()
    yield gate
    gate.set()


def deterministic(cluster: Cluster) -> None:
    for d in cluster.decode:
        d.behaviour.deterministic = True


def arm(cluster: Cluster, fault: str, stall: asyncio.Event, k: int = K, shots: int = 1) -> None:
    """The first ``shots`` streams to reach any D are cut after ``k`` tokens by ``fault``."""
    shot = Shot(shots)
    for d in cluster.decode:
        d.behaviour.shot = shot
        if fault == "stall":
            d.behaviour.stall_after, d.behaviour.stall_gate = k, stall
        else:
            setattr(d.behaviour, FAULTS[fault], k)


async def router(cluster: Cluster, mode: str, **overrides: Any) -> tuple[str, Any]:
    if mode.startswith("push"):
        for p in cluster.prefill:
            p.behaviour.transfer_mode = "push"
    if mode == "pipelined":  # each leg is given the other's identity
        ids = {"engine_id": "e", "kv_host": "127.0.0.1", "kv_port": 5600}
        overrides.update(prefill_extra=ids, decode_extra=ids)
    migration = {"max_attempts": 2, "stall_timeout": 1.0, **overrides.pop("migration", {})}
    return await cluster.router(mode, migration=migration, **overrides)


def events(text: str) -> list[dict[str, Any]]:
    """A stream's chunks, checked to end with one ``[DONE]`` and to hold no error event."""
    raw = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert raw[-1] == "[DONE]" and raw.count("[DONE]") == 1, text[-300:]
    docs = [json.loads(e) for e in raw[:-1]]
    assert not any("error" in d for d in docs), text[-300:]
    return docs


def content(doc: dict[str, Any]) -> str:
    text = ""
    for choice in doc["choices"]:
        delta = choice.get("delta")
        text += (delta.get("content") or "") if delta is not None else choice["text"]
    return text


def reference(body: dict[str, Any]) -> str:
    """The deterministic model's uninterrupted answer, as the engine computes it."""
    return "".join(map(chr, deterministic_reply(prompt_ids(body), N)))


def check_one_answer(docs: list[dict[str, Any]], chat: bool) -> None:
    """One answer: one id, created, model and object; one final chunk; choice index 0."""
    assert len({(d["id"], d["created"], d["model"], d["object"]) for d in docs}) == 1
    assert docs[0]["object"] == ("chat.completion.chunk" if chat else "text_completion")
    finals = [c for d in docs for c in d["choices"] if c.get("finish_reason") is not None]
    assert [c["finish_reason"] for c in finals] == ["length"]
    assert all(c["index"] == 0 for d in docs for c in d["choices"])


def continuation_of(cluster: Cluster) -> tuple[FakeEngine, dict[str, Any]]:
    """The D that ran the continuation (a prompt of token ids), and its body."""
    found = [(d, r.body) for d in cluster.decode for r in d.received if _continued(r.body)]
    assert len(found) == 1, found
    return found[0]


def _continued(body: dict[str, Any]) -> bool:
    return isinstance(body.get("prompt"), list)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("fault", ["drop", "stall"])
@pytest.mark.parametrize("mode", ["aggregated", "pull", "push", "push-sequential", "pipelined"])
async def test_a_cut_stream_continues_on_another_engine_token_for_token(
    cluster2: Cluster,
    client: httpx.AsyncClient,
    stall: asyncio.Event,
    mode: str,
    fault: str,
    endpoint: str,
) -> None:
    """D dies or stalls after K tokens: the client's answer is the uninterrupted one."""
    deterministic(cluster2)
    path, body = PATHS[endpoint]
    url, ctx = await router(cluster2, mode)
    whole = await client.post(url + path, json=body)
    before = {d.name: len(d.received) for d in cluster2.decode}
    arm(cluster2, fault, stall)
    cut = await client.post(url + path, json=body)
    assert cut.status_code == 200
    docs, uncut = events(cut.text), events(whole.text)
    assert "".join(map(content, docs)) == "".join(map(content, uncut)) == reference(body)
    check_one_answer(docs, endpoint == "chat")
    cause = "stall" if fault == "stall" else CAUSES[fault]
    assert metric(ctx, "pdrouter_migrations_total", mode=mode, cause=cause) == 1
    d, cont = continuation_of(cluster2)
    assert cont["max_tokens"] == N - K and cont["return_token_ids"] is True
    first = [
        e for e in cluster2.decode for r in e.received[before[e.name] :] if not _continued(r.body)
    ]
    assert len(first) == 1 and first[0] is not d  # continued on the other D
    await eventually(lambda: ctx.registry.slots_in_use() == 0)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("fault", ["error_event", "end"])
async def test_an_error_event_or_an_early_end_is_a_cut_too(
    cluster2: Cluster, client: httpx.AsyncClient, stall: asyncio.Event, fault: str, endpoint: str
) -> None:
    deterministic(cluster2)
    path, body = PATHS[endpoint]
    url, ctx = await router(cluster2, "pull")
    arm(cluster2, fault, stall)
    r = await client.post(url + path, json=body)
    docs = events(r.text)
    assert "".join(map(content, docs)) == reference(body)
    check_one_answer(docs, endpoint == "chat")
    assert metric(ctx, "pdrouter_migrations_total", cause=CAUSES[fault]) == 1


@pytest.mark.parametrize("k", [0, 1, N - 1, N])
@pytest.mark.parametrize("fault", ["drop", "error_event", "end"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_any_cut_point_gives_the_uninterrupted_answer(
    cluster2: Cluster,
    client: httpx.AsyncClient,
    stall: asyncio.Event,
    endpoint: str,
    fault: str,
    k: int,
) -> None:
    """Cut before the first token, after it, before the last and after the last (all sent:
    the router closes the answer, no engine asked again). A cut before any byte reached the
    router may surface as a failed first read, which ``retries`` retries from the start:
    the answer is the same either way, and only one of the two happens."""
    deterministic(cluster2)
    path, body = PATHS[endpoint]
    body = {**body, "stream_options": {"include_usage": True}}
    url, ctx = await router(cluster2, "pull", retries={"max_attempts": 2})
    arm(cluster2, fault, stall, k=k)
    docs = events((await client.post(url + path, json=body)).text)
    assert "".join(map(content, docs)) == reference(body)
    check_one_answer([d for d in docs if d["choices"]], endpoint == "chat")
    assert docs[-1]["usage"]["completion_tokens"] == N
    migrations = metric(ctx, "pdrouter_migrations_total")
    retries = metric(ctx, "pdrouter_retries_total")
    if k == N:
        assert (migrations, retries) == (0, 0)
    elif k > 0 or endpoint == "chat":  # the chat's role event went before the cut
        assert (migrations, retries) == (1, 0)
    else:
        assert migrations + retries == 1


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_usage_counts_every_token_the_client_received(
    cluster2: Cluster, client: httpx.AsyncClient, stall: asyncio.Event, endpoint: str
) -> None:
    deterministic(cluster2)
    path, body = PATHS[endpoint]
    body = {**body, "stream_options": {"include_usage": True}}
    url, _ = await router(cluster2, "aggregated")
    whole = events((await client.post(url + path, json=body)).text)
    arm(cluster2, "drop", stall)
    docs = events((await client.post(url + path, json=body)).text)
    usage = [d["usage"] for d in docs if d.get("usage")]
    assert len(usage) == 1 and docs[-1]["usage"] == usage[0]
    assert usage[0] == whole[-1]["usage"]
    assert usage[0]["completion_tokens"] == N


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_token_ids_reach_only_a_client_that_asked(
    cluster2: Cluster, client: httpx.AsyncClient, stall: asyncio.Event, endpoint: str
) -> None:
    """The router asks D for ids; the client gets them (the prompt's once) only if it asked,
    and otherwise null, as vLLM sends a stream that did not ask."""
    deterministic(cluster2)
    path, body = PATHS[endpoint]
    url, _ = await router(cluster2, "aggregated")
    arm(cluster2, "drop", stall)
    docs = events((await client.post(url + path, json=body)).text)
    choices = [c for d in docs for c in d["choices"]]
    assert all(c.get("token_ids") is None and c.get("prompt_token_ids") is None for c in choices)
    assert all(d.get("prompt_token_ids") is None for d in docs)
    arm(cluster2, "drop", stall)
    docs = events((await client.post(url + path, json={**body, "return_token_ids": True})).text)
    choices = [c for d in docs for c in d["choices"]]
    ids = [t for c in choices for t in c.get("token_ids") or ()]
    assert ids == deterministic_reply(prompt_ids(body), N)
    prompts = [c["prompt_token_ids"] for c in choices if c.get("prompt_token_ids")]
    prompts += [d["prompt_token_ids"] for d in docs if d.get("prompt_token_ids")]
    assert prompts == [prompt_ids(body)]


async def test_an_answer_cut_after_its_last_token_is_closed_by_the_router(
    cluster2: Cluster, client: httpx.AsyncClient, stall: asyncio.Event
) -> None:
    """max_tokens reached exactly at the cut: nothing to continue; the usage and [DONE] the
    engine did not send come from the router, and no engine is asked again."""
    deterministic(cluster2)
    body = {**COMPLETION, "stream_options": {"include_usage": True}}
    url, ctx = await router(cluster2, "aggregated")
    arm(cluster2, "end", stall, k=N)
    docs = events((await client.post(url + "/v1/completions", json=body)).text)
    assert "".join(map(content, docs)) == reference(body)
    assert docs[-1]["usage"]["completion_tokens"] == N
    assert sum(len(d.received) for d in cluster2.decode) == 1
    assert metric(ctx, "pdrouter_migrations_total") == 0


async def test_a_second_cut_continues_again_up_to_max_attempts(
    cluster2: Cluster, client: httpx.AsyncClient, stall: asyncio.Event
) -> None:
    """Two Ds, both cut once: the second continuation has no D left that did not fail, so
    the stream ends with the error event as without migration."""
    deterministic(cluster2)
    url, ctx = await router(cluster2, "aggregated")
    arm(cluster2, "drop", stall, shots=2)
    r = await client.post(url + "/v1/completions", json=COMPLETION)
    assert stream_error(r.text)["code"] == "decode_unreachable"
    assert metric(ctx, "pdrouter_migrations_total") == 1


@pytest.mark.parametrize(
    "extra",
    [{"n": 2}, {"logprobs": 1}, {"stop": ["zz"]}, {"best_of": 2}, {"frequency_penalty": 0.5}],
)
async def test_requests_it_cannot_continue_exactly_fail_as_before(
    cluster2: Cluster, client: httpx.AsyncClient, stall: asyncio.Event, extra: dict[str, Any]
) -> None:
    deterministic(cluster2)
    url, ctx = await router(cluster2, "aggregated")
    arm(cluster2, "drop", stall)
    r = await client.post(url + "/v1/completions", json={**COMPLETION, **extra})
    assert stream_error(r.text)["code"] == "decode_unreachable"
    assert metric(ctx, "pdrouter_migrations_total") == 0
    assert all("return_token_ids" not in rec.body for d in cluster2.decode for rec in d.received)


async def test_max_attempts_zero_turns_it_off(
    cluster2: Cluster, client: httpx.AsyncClient, stall: asyncio.Event
) -> None:
    deterministic(cluster2)
    url, _ = await router(cluster2, "aggregated", migration={"max_attempts": 0})
    arm(cluster2, "drop", stall)
    r = await client.post(url + "/v1/completions", json=COMPLETION)
    assert stream_error(r.text)["code"] == "decode_unreachable"
    assert all("return_token_ids" not in rec.body for d in cluster2.decode for rec in d.received)


async def test_one_engine_left_means_no_migration(
    cluster: Cluster, client: httpx.AsyncClient, stall: asyncio.Event
) -> None:
    """The only D failed: nowhere to continue, the error event as before."""
    deterministic(cluster)
    url, ctx = await router(cluster, "aggregated")
    arm(cluster, "error_event", stall)
    r = await client.post(url + "/v1/completions", json=COMPLETION)
    assert stream_error(r.text)["message"] == "engine died"
    assert metric(ctx, "pdrouter_migrations_total") == 0
    # Every cause's series exists at 0 before the first migration (rates have data).
    families = text_string_to_metric_families(ctx.metrics.render().decode())
    samples = [x for f in families for x in f.samples if x.name == "pdrouter_migrations_total"]
    assert sorted(x.labels["cause"] for x in samples) == [
        "disconnect",
        "ejected",
        "error_event",
        "stall",
    ]


async def test_no_migration_once_the_client_left(
    cluster2: Cluster, client: httpx.AsyncClient, stall: asyncio.Event
) -> None:
    """The client leaves while D stalls (the router's stall timeout far away): the stalled
    leg is closed and no engine is asked to continue."""
    deterministic(cluster2)
    url, ctx = await router(cluster2, "pull", migration={"stall_timeout": 60})
    arm(cluster2, "stall", stall)
    stalled = lambda: any(d.stalled.is_set() for d in cluster2.decode)  # noqa: E731
    await client_leaves(url + "/v1/completions", COMPLETION, stalled)
    await eventually(lambda: all(d.active == 0 for d in cluster2.decode))
    assert not [r for d in cluster2.decode for r in d.received if _continued(r.body)]
    assert metric(ctx, "pdrouter_migrations_total") == 0


async def test_the_failed_d_is_judged_and_the_access_log_counts_the_migration(
    cluster2: Cluster,
    client: httpx.AsyncClient,
    stall: asyncio.Event,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The cut leg is judged as a failed leg is (one engine fault ejects, here); the
    request's one access line says it migrated once, its outcome a success."""
    deterministic(cluster2)
    url, ctx = await router(
        cluster2, "pull", breaker={"failure_threshold": 1}, logging={"access": True}
    )
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    arm(cluster2, "drop", stall)
    r = await client.post(url + "/v1/completions", json=COMPLETION)
    assert "".join(map(content, events(r.text))) == reference(COMPLETION)
    d, _ = continuation_of(cluster2)
    states = {i.url: i.breaker.state for i in ctx.registry.instances() if i.role == "decode"}
    cont_url = cluster2.decode_urls[cluster2.decode.index(d)]
    assert [u for u, s in states.items() if s is not BreakerState.CLOSED] == [
        u for u in cluster2.decode_urls if u != cont_url
    ]
    [line] = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]
    assert " migrations=1" in line and " outcome=success " in line


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("fault", ["drop", "error_event", "stall"])
@pytest.mark.parametrize("mode", ["aggregated", "pull", "push"])
async def test_a_non_streamed_answer_is_assembled_across_the_cut(
    cluster2: Cluster,
    client: httpx.AsyncClient,
    stall: asyncio.Event,
    mode: str,
    fault: str,
    endpoint: str,
) -> None:
    """With ``migration.non_streamed``, D's leg is streamed to the router, which continues it
    past the cut and answers with the whole body, the uninterrupted answer's text and usage."""
    deterministic(cluster2)
    path, body = PATHS[endpoint]
    body = {**body, "stream": False}
    url, ctx = await router(cluster2, mode, migration={"non_streamed": True})
    arm(cluster2, fault, stall)
    r = await client.post(url + path, json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    choice = doc["choices"][0]
    text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    assert text == reference(body) and choice["finish_reason"] == "length"
    assert doc["object"] == ("chat.completion" if endpoint == "chat" else "text_completion")
    assert doc["usage"]["completion_tokens"] == N
    assert doc["usage"]["prompt_tokens"] == len(prompt_ids(body))
    assert choice["token_ids"] is None and doc.get("kv_transfer_params") is None
    cause = "stall" if fault == "stall" else CAUSES[fault]
    assert metric(ctx, "pdrouter_migrations_total", cause=cause) == 1


async def test_a_non_streamed_answer_that_cannot_continue_is_an_error_response(
    cluster: Cluster, client: httpx.AsyncClient, stall: asyncio.Event
) -> None:
    deterministic(cluster)
    url, ctx = await router(cluster, "aggregated", migration={"non_streamed": True})
    arm(cluster, "drop", stall)
    r = await client.post(url + "/v1/completions", json={**COMPLETION, "stream": False})
    assert r.status_code == 502 and r.json()["error"]["code"] == "decode_unreachable"
    assert metric(ctx, "pdrouter_requests_total", outcome="upstream_error") == 1


async def test_non_streamed_answers_are_the_engines_own_unless_asked(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    """By default a non-streamed request is not migrated: D answers it whole, as before."""
    deterministic(cluster2)
    url, _ = await router(cluster2, "aggregated")
    r = await client.post(url + "/v1/completions", json={**COMPLETION, "stream": False})
    assert r.json()["choices"][0]["text"] == reference(COMPLETION)
    assert all(not rec.body.get("stream") for d in cluster2.decode for rec in d.received)


@pytest.mark.parametrize("fault", ["drop", "stall"])
@pytest.mark.parametrize("mode", ["pull", "pipelined"])
async def test_the_only_d_failed_continues_on_p_alone(
    cluster: Cluster, client: httpx.AsyncClient, stall: asyncio.Event, mode: str, fault: str
) -> None:
    """1P1D, the only D cut: no D is left that has not failed, so P serves the continuation
    alone (``prefill_alone``), the answer the uninterrupted one; P's leg of the first dispatch
    and its whole continuation are both P's, and no slot is held after."""
    for engine in cluster.engines:
        engine.behaviour.deterministic = True
    url, ctx = await router(cluster, mode)
    arm(cluster, fault, stall)
    docs = events((await client.post(url + "/v1/completions", json=COMPLETION)).text)
    assert "".join(map(content, docs)) == reference(COMPLETION)
    check_one_answer(docs, False)
    cause = "stall" if fault == "stall" else CAUSES[fault]
    assert metric(ctx, "pdrouter_migrations_total", mode=mode, cause=cause) == 1
    assert metric(ctx, "pdrouter_disagg_decisions_total", decision="prefill_alone") == 1
    (p,) = cluster.prefill
    alone = [r.body for r in p.received if _continued(r.body)]
    assert len(alone) == 1 and alone[0]["max_tokens"] == N - K
    assert "kv_transfer_params" not in alone[0]
    assert not [r for r in cluster.decode[0].received if _continued(r.body)]
    await eventually(lambda: ctx.registry.slots_in_use() == 0)


async def test_prefill_alone_off_means_no_migration_without_another_d(
    cluster: Cluster, client: httpx.AsyncClient, stall: asyncio.Event
) -> None:
    for engine in cluster.engines:
        engine.behaviour.deterministic = True
    url, ctx = await router(cluster, "pull", migration={"prefill_alone": False})
    arm(cluster, "drop", stall)
    r = await client.post(url + "/v1/completions", json=COMPLETION)
    assert stream_error(r.text)["code"] == "decode_unreachable"
    assert metric(ctx, "pdrouter_migrations_total") == 0
    assert not [r for r in cluster.prefill[0].received if _continued(r.body)]


def _eject(ctx: Any, url: str, how: str) -> None:
    """What the breaker does on a refused connection, or the health monitor on failed checks."""
    (inst,) = (i for i in ctx.registry.instances() if i.url == url)
    if how == "breaker":
        inst.breaker.record(Fault.REFUSED)
    else:
        inst.healthy = False


async def _eject_after_k(
    client: httpx.AsyncClient, url: str, ctx: Any, cluster: Cluster, how: str
) -> str:
    """The stream, its D ejected once the client has read ``K`` tokens (D stalled there)."""
    text, ejected = "", False
    async with client.stream("POST", url + "/v1/completions", json=COMPLETION) as r:
        async for event in r.aiter_text():
            text += event
            if not ejected and text.count('"text"') >= K:  # D holds its next token
                (n,) = (i for i, d in enumerate(cluster.decode) if d.stalled.is_set())
                _eject(ctx, cluster.decode_urls[n], how)
                ejected = True
    return text


@pytest.mark.parametrize("how", ["breaker", "health"])
async def test_an_ejected_d_mid_stream_is_a_cut(
    cluster2: Cluster, client: httpx.AsyncClient, stall: asyncio.Event, how: str
) -> None:
    """D still streams (here: holds its next token, far from the stall timeout) when it is
    ejected: its stream is cut at once and continued on the other D, token for token."""
    deterministic(cluster2)
    url, ctx = await router(cluster2, "pull", migration={"stall_timeout": 60})
    arm(cluster2, "stall", stall)
    docs = events(await _eject_after_k(client, url, ctx, cluster2, how))
    assert "".join(map(content, docs)) == reference(COMPLETION)
    check_one_answer(docs, False)
    assert metric(ctx, "pdrouter_migrations_total", cause="ejected") == 1
    assert metric(ctx, "pdrouter_migrations_total") == 1
    d, _ = continuation_of(cluster2)
    assert not d.stalled.is_set()
    await eventually(lambda: all(d.active == 0 for d in cluster2.decode))
    await eventually(lambda: ctx.registry.slots_in_use() == 0)


async def test_an_ejected_d_with_nowhere_to_go_keeps_its_stream(
    cluster: Cluster, client: httpx.AsyncClient, stall: asyncio.Event
) -> None:
    """The only engine ejected mid-stream: cutting it could only fail the answer, so its
    stream goes on and ends whole."""
    deterministic(cluster)
    url, ctx = await router(cluster, "aggregated", migration={"stall_timeout": 60})
    arm(cluster, "stall", stall)

    async def eject_then_go_on() -> str:
        async with client.stream("POST", url + "/v1/completions", json=COMPLETION) as r:
            text = ""
            async for event in r.aiter_text():
                text += event
                if not stall.is_set() and text.count('"text"') >= K:
                    _eject(ctx, cluster.decode_urls[0], "breaker")
                    stall.set()
            return text

    docs = events(await eject_then_go_on())
    assert "".join(map(content, docs)) == reference(COMPLETION)
    assert metric(ctx, "pdrouter_migrations_total") == 0
