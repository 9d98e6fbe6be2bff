"""LoRA adapters across P and D over fake engines on real sockets (router/engines/adapters.py):
the router learns which adapters each engine holds from its /v1/models, sends an adapter's
request only to a P and a D that both hold it (the legs keep the adapter's name), answers
vLLM's 404 where no pair holds it, lists the adapters in /v1/models as `vllm serve` does,
sees an adapter loaded later, keeps each adapter's KV blocks apart from the base model's in
its index, and counts adapter requests under a bounded label set."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from router.app import AppContext, create_app
from router.config import ConfigError, parse_config
from tests.conftest import Cluster, eventually, metric
from tests.fakes.fake_vllm import FakeEngine
from tests.fakes.kv_cluster import events_config, synced, with_events
from tests.fakes.servers import serve

LORA = {"enabled": True, "refresh_interval": 0.1}
IDENTITY = {"engine_id": "fake-prefill", "kv_host": "127.0.0.1", "kv_port": 5600}
SYSTEM = "You are an assistant. " + "Follow the house rules carefully. " * 20


def _body(model: str, tag: str) -> dict[str, Any]:
    return {"model": model, "prompt": f"{tag} " * 8, "max_tokens": 2}


def _hold(cluster: Cluster, held: dict[str, dict[str, str]]) -> None:
    """Each engine's adapters, by engine name (p0, d1, ...); every other engine holds none
    (but has LoRA on: it refuses an adapter's request with vLLM's 404)."""
    for engine in cluster.engines:
        engine.behaviour.adapters = held.get(engine.name, {})


async def _router(cluster: Cluster, mode: str, **overrides: Any) -> tuple[str, AppContext]:
    model = {"lora": {**LORA, **overrides.pop("lora", {})}, **overrides.pop("model", {})}
    if mode.startswith("push"):
        for p in cluster.prefill:
            p.behaviour.transfer_mode = "push"
        overrides.setdefault("prefill_extra", IDENTITY)
    url, ctx = await cluster.router(mode, health_checks=True, model=model, **overrides)
    await _learned(ctx, cluster)
    return url, ctx


async def _learned(ctx: AppContext, cluster: Cluster) -> None:
    """Wait until the router's view of every engine's adapters is what the engine holds."""
    engines = {u: e for u, e in zip(_urls(cluster), cluster.engines, strict=True)}

    def caught_up() -> bool:
        return all(
            set(i.adapters) == set(engines[i.url].behaviour.adapters or {})
            for i in ctx.registry.instances()
        )

    await eventually(caught_up)


def _urls(cluster: Cluster) -> list[str]:
    return [*cluster.prefill_urls, *cluster.decode_urls]


def _legs(engine: FakeEngine) -> list[Any]:
    return [r for r in engine.received if r.path not in ("/tokenize", "/detokenize")]


def _pairs(cluster: Cluster, model: str) -> list[tuple[str, str]]:
    """(P, D) of every request naming ``model``, by the request id both legs carry."""
    decode = {r.request_id: e.name for e in cluster.decode for r in _legs(e)}
    return [
        (e.name, decode[r.request_id])
        for e in cluster.prefill
        for r in _legs(e)
        if r.body.get("model") == model
    ]


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_an_adapter_s_legs_land_only_on_a_p_and_a_d_that_hold_it(
    cluster2: Cluster, client: httpx.AsyncClient, mode: str
) -> None:
    """p1 and d1 hold `sql`, p0 and d0 hold nothing (the engines an idle router picks
    first): every `sql` request runs on p1 then d1, both legs naming `sql`; the base model's
    requests are routed as ever."""
    _hold(cluster2, {"p1": {"sql": "/adapters/sql"}, "d1": {"sql": "/adapters/sql"}})
    url, ctx = await _router(cluster2, mode)
    # One after the other: the policy's rotating tie-break alone would alternate engines.
    for i in range(6):
        r = await client.post(url + "/v1/completions", json=_body("sql", f"a{i}"))
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "sql"
    for i in range(6):
        r = await client.post(url + "/v1/completions", json=_body("tiny", f"b{i}"))
        assert r.status_code == 200, r.text
    assert _pairs(cluster2, "sql") == [("p1", "d1")] * 6
    legs = [r for e in cluster2.engines for r in _legs(e) if r.body["prompt"].startswith("a")]
    assert len(legs) == 12 and all(r.body["model"] == "sql" for r in legs)
    assert len(_pairs(cluster2, "tiny")) == 6  # the base model's: wherever the policy says
    assert metric(ctx, "pdrouter_lora_requests_total", model="tiny", adapter="sql") == 6
    # The base model's families count the adapter's requests under the base model's name.
    assert metric(ctx, "pdrouter_disagg_decisions_total", model="tiny") == 12


async def test_a_d_is_only_taken_where_a_p_holding_the_adapter_can_pair_with_it(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    """Both Ds hold `sql`, only p0 does, and p0 runs another vLLM version than d0: d0 can
    never get p0's KV, so every `sql` decode slot is taken on d1."""
    _hold(
        cluster2,
        {"p0": {"sql": "/a"}, "d0": {"sql": "/a"}, "d1": {"sql": "/a"}, "p1": {}},
    )
    versions = ["0.32.1", "0.32.0", "0.32.0", "0.32.1"]  # p0, p1, d0, d1
    for engine, version in zip(cluster2.engines, versions, strict=True):
        engine.behaviour.version = version
    url, ctx = await _router(cluster2, "pull")
    await eventually(lambda: all(i.facts.version for i in ctx.registry.instances()))
    for i in range(4):
        r = await client.post(url + "/v1/completions", json=_body("sql", f"a{i}"))
        assert r.status_code == 200, r.text
    assert _pairs(cluster2, "sql") == [("p0", "d1")] * 4


async def test_aggregated_mode_sends_an_adapter_only_to_ds_that_hold_it(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    _hold(cluster2, {"d1": {"sql": "/adapters/sql"}})
    url, _ = await _router(cluster2, "aggregated")
    for i in range(4):
        r = await client.post(url + "/v1/completions", json=_body("sql", f"a{i}"))
        assert r.status_code == 200, r.text
    assert [len(_legs(d)) for d in cluster2.decode] == [0, 4]
    assert all(r.body["model"] == "sql" for r in _legs(cluster2.decode[1]))


@pytest.mark.parametrize("mode", ["pull", "aggregated"])
async def test_an_adapter_no_pair_holds_gets_vllm_s_404_and_reaches_no_engine(
    cluster2: Cluster, client: httpx.AsyncClient, mode: str
) -> None:
    """`ghost` is held nowhere; `prompt-only` by a P and no D: both are unknown models, in
    vLLM's words, and no engine gets a generate request."""
    _hold(cluster2, {"p0": {"prompt-only": "/a"}})
    url, ctx = await _router(cluster2, mode)
    for name in ("ghost", "prompt-only"):
        r = await client.post(url + "/v1/completions", json=_body(name, "x"))
        assert r.status_code == 404, r.text
        assert r.json() == {
            "error": {
                "message": f"The model `{name}` does not exist. Valid aliases: tiny.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }
    assert all(_legs(e) == [] for e in cluster2.engines)
    assert metric(ctx, "pdrouter_lora_requests_total") == 0


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_an_adapter_whose_holders_are_out_gets_a_503_not_a_404(
    cluster2: Cluster, client: httpx.AsyncClient, role: str
) -> None:
    """p1 and d1 hold `sql`; the one of ``role`` fails its health checks: the adapter still
    exists, so the answer is the usual 503 for that role, with Retry-After, and no leg runs;
    the base model is still served by the others."""
    _hold(cluster2, {"p1": {"sql": "/a"}, "d1": {"sql": "/a"}})
    url, ctx = await _router(cluster2, "pull")
    down = cluster2.prefill[1] if role == "prefill" else cluster2.decode[1]
    down.behaviour.health_status = 500
    await eventually(lambda: any(i.healthy is False for i in ctx.registry.instances()))
    r = await client.post(url + "/v1/completions", json=_body("sql", "x"))
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == f"no_healthy_{role}"
    assert "retry-after" in r.headers
    assert _pairs(cluster2, "sql") == []
    r = await client.post(url + "/v1/completions", json=_body("tiny", "y"))
    assert r.status_code == 200, r.text


async def test_with_lora_off_an_adapter_name_is_an_unknown_model(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    """The default: the router learns no adapters (its context-length read of /v1/models
    aside), and an adapter is a 404."""
    _hold(cluster2, {"p0": {"sql": "/a"}, "d0": {"sql": "/a"}})
    url, ctx = await cluster2.router("pull", health_checks=True)
    r = await client.post(url + "/v1/completions", json=_body("sql", "x"))
    assert r.status_code == 404, r.text
    assert all(not i.adapters for i in ctx.registry.instances())


async def test_v1_models_lists_the_adapters_a_pair_serves_as_vllm_does(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    """Each served adapter once, after the base model, with vLLM's `root` and `parent`; one
    held by a P only is not served, so not listed."""
    _hold(
        cluster2,
        {
            "p0": {"sql": "/adapters/sql", "chat": "/adapters/chat"},
            "p1": {"prompt-only": "/adapters/x"},
            "d0": {"sql": "/adapters/sql"},
            "d1": {"chat": "/adapters/chat", "sql": "/adapters/sql"},
        },
    )
    url, _ = await _router(cluster2, "pull")
    doc = (await client.get(url + "/v1/models")).json()
    ids = [c["id"] for c in doc["data"]]
    assert ids == ["tiny", "chat", "sql"]
    chat = doc["data"][1]
    assert chat["parent"] == "tiny" and chat["root"] == "/adapters/chat"
    assert chat["object"] == "model"


async def test_an_adapter_loaded_later_is_routed_once_the_router_read_it_again(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    """`sql` is loaded on p1 and d1 while the router runs (as /v1/load_lora_adapter does):
    a 404 before, served by them after the next read; unloaded from d1, a 404 again."""
    _hold(cluster2, {})
    url, ctx = await _router(cluster2, "pull")
    r = await client.post(url + "/v1/completions", json=_body("sql", "x"))
    assert r.status_code == 404
    cluster2.prefill[1].behaviour.adapters = {"sql": "/adapters/sql"}
    cluster2.decode[1].behaviour.adapters = {"sql": "/adapters/sql"}
    await _learned(ctx, cluster2)
    r = await client.post(url + "/v1/completions", json=_body("sql", "y"))
    assert r.status_code == 200, r.text
    assert _pairs(cluster2, "sql") == [("p1", "d1")]
    assert "sql" in [c["id"] for c in (await client.get(url + "/v1/models")).json()["data"]]
    cluster2.decode[1].behaviour.adapters = {}
    await _learned(ctx, cluster2)
    r = await client.post(url + "/v1/completions", json=_body("sql", "z"))
    assert r.status_code == 404


async def test_a_tokenize_call_naming_an_adapter_goes_to_an_engine_that_holds_it(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    """Forwarded endpoints pick their engine among the adapter's holders (here d1 only:
    decode engines first), never one that would answer it with a 404."""
    _hold(cluster2, {"p1": {"sql": "/a"}, "d1": {"sql": "/a"}})
    url, _ = await _router(cluster2, "pull")
    for _ in range(3):
        r = await client.post(url + "/tokenize", json={"model": "sql", "prompt": "hi"})
        assert r.status_code == 200, r.text
    assert [len(e.received) for e in cluster2.engines] == [0, 0, 0, 3]


async def test_the_adapter_label_set_is_bounded(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """With `max_adapter_labels: 1` the first adapter seen has its label, the next `other`."""
    _hold(cluster, {"p0": {"a": "/a", "b": "/b"}, "d0": {"a": "/a", "b": "/b"}})
    url, ctx = await _router(cluster, "pull", lora={"max_adapter_labels": 1})
    for name in ("a", "b", "b", "a"):
        r = await client.post(url + "/v1/completions", json=_body(name, "x"))
        assert r.status_code == 200, r.text
    assert metric(ctx, "pdrouter_lora_requests_total", adapter="a") == 2
    assert metric(ctx, "pdrouter_lora_requests_total", adapter="other") == 2
    assert metric(ctx, "pdrouter_lora_requests_total", adapter="b") == 0


def test_lora_settings_are_validated() -> None:
    cfg: dict[str, Any] = {
        "models": [{"name": "m", "mode": "aggregated", "decode": [{"url": "http://d:1"}]}]
    }
    for bad in (
        {"refresh_interval": 0},
        {"max_adapter_labels": -1},
        {"enable": True},
        {"load_timeout": 0},
        {"modules": {"sql": "/a"}},  # without enabled
        {"enabled": True, "modules": {"sql": " "}},
        {"enabled": True, "modules": {"m": "/a"}},  # the model's own name
    ):
        cfg["models"][0]["lora"] = bad
        with pytest.raises(ConfigError, match="lora"):
            parse_config(cfg)


# -- adapters the router loads itself (lora.modules) ---------------------------------------

MODULES = {"modules": {"sql": "/adapters/sql"}}


async def test_a_configured_adapter_is_loaded_once_on_the_chosen_engines_before_its_legs(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """No engine holds `sql`; three requests at once while P's load takes a while: P and D
    are each asked once, every request is served after the loads (a fake engine answers an
    adapter it lacks with a 404), and the router then counts them as holders."""
    _hold(cluster, {})
    cluster.prefill[0].behaviour.lora_load_delay = 0.3
    url, ctx = await _router(cluster, "pull", lora=MODULES)
    answers = await asyncio.gather(
        *(client.post(url + "/v1/completions", json=_body("sql", f"a{i}")) for i in range(3))
    )
    assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
    assert [e.lora_loads for e in cluster.engines] == [["sql"], ["sql"]]
    assert all(r.body["model"] == "sql" for e in cluster.engines for r in _legs(e))
    assert all("sql" in i.adapters for i in ctx.registry.instances())
    ids = [c["id"] for c in (await client.get(url + "/v1/models")).json()["data"]]
    assert ids == ["tiny", "sql"]


async def test_engines_that_hold_a_configured_adapter_are_preferred_to_loading_it(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    _hold(cluster2, {"p1": {"sql": "/adapters/sql"}, "d1": {"sql": "/adapters/sql"}})
    url, _ = await _router(cluster2, "pull", lora=MODULES)
    for i in range(4):
        r = await client.post(url + "/v1/completions", json=_body("sql", f"a{i}"))
        assert r.status_code == 200, r.text
    assert _pairs(cluster2, "sql") == [("p1", "d1")] * 4
    assert all(e.lora_loads == [] for e in cluster2.engines)


async def test_a_failed_load_answers_502_in_words_and_runs_no_leg(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    """D cannot load `sql` (a wrong path): a 502 `adapter_load_failed` naming the adapter,
    the role and the engine's reason; no generate leg anywhere, the slot given back."""
    _hold(cluster, {})
    cluster.decode[0].behaviour.lora_load_status = 404
    url, ctx = await _router(cluster, "pull", lora=MODULES)
    r = await client.post(url + "/v1/completions", json=_body("sql", "x"))
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "adapter_load_failed"
    assert "'sql'" in error["message"] and "decode engine" in error["message"]
    assert "No adapter found for /adapters/sql" in error["message"]
    assert all(_legs(e) == [] for e in cluster.engines)
    assert metric(ctx, "pdrouter_upstream_errors_total", code="adapter_load_failed") == 1


async def test_a_load_past_load_timeout_answers_502(
    cluster: Cluster, client: httpx.AsyncClient
) -> None:
    _hold(cluster, {})
    cluster.decode[0].behaviour.lora_load_delay = 5
    url, _ = await _router(cluster, "aggregated", lora={**MODULES, "load_timeout": 0.2})
    r = await client.post(url + "/v1/completions", json=_body("sql", "x"))
    assert r.status_code == 502, r.text
    error = r.json()["error"]  # the wait's bound or the call's own timeout: both 0.2 s
    assert error["code"] == "adapter_load_failed" and "'sql'" in error["message"]
    assert _legs(cluster.decode[0]) == []


# -- the KV index --------------------------------------------------------------------------


def _chat(model: str, question: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": model, "messages": messages, "max_tokens": 4}


async def _cached_router(cluster: Cluster) -> tuple[str, AppContext]:
    engines = dict(zip(_urls(cluster), cluster.engines, strict=True))
    cfg = events_config(cluster.config("pull", model={"lora": LORA}), engines)
    app = create_app(parse_config(cfg), health_checks=True)
    url = await cluster.stack.enter_async_context(serve(app))
    ctx: AppContext = app.state.ctx
    cluster.routers.append(ctx)
    await _learned(ctx, cluster)
    return url, ctx


async def _send(
    cluster: Cluster, client: httpx.AsyncClient, url: str, ctx: AppContext, body: dict[str, Any]
) -> tuple[str, int | None, float]:
    """(P's name, what P found cached, what the router predicted for P) of one request."""
    await synced([ctx], cluster.engines)
    before = metric(ctx, "pdrouter_cache_predicted_tokens_sum", role="prefill")
    r = await client.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    question = body["messages"][1]["content"]
    ((name, rec),) = [
        (e.name, rec)
        for e in cluster.prefill
        for rec in _legs(e)
        if rec.body["messages"][1]["content"] == question
    ]
    predicted = metric(ctx, "pdrouter_cache_predicted_tokens_sum", role="prefill") - before
    return name, rec.cached, predicted


async def test_an_adapter_s_prefix_never_matches_the_base_model_s_or_another_adapter_s(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    """Every engine holds `sql` and `chat`. The base model's long prompt is cached on one P:
    the same prompt for `sql` finds nothing there and the router predicts nothing; a second
    `sql` request finds the first's blocks, as predicted; `chat` still finds nothing. The
    engines' LoRA blocks are all indexed (none left unkeyed)."""
    held = {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    _hold(cluster2, {e.name: held for e in cluster2.engines})
    await with_events(cluster2.engines, cluster2.stack)
    url, ctx = await _cached_router(cluster2)
    _, found, predicted = await _send(cluster2, client, url, ctx, _chat("tiny", "q0"))
    assert (found, predicted) == (0, 0)
    _, found, predicted = await _send(cluster2, client, url, ctx, _chat("tiny", "q1"))
    assert found and found == predicted  # the base model's prompt is cached and indexed
    base_p = _pairs(cluster2, "tiny")[0][0]
    name, found, predicted = await _send(cluster2, client, url, ctx, _chat("sql", "q2"))
    assert (found, predicted) == (0, 0), name
    name, found, predicted = await _send(cluster2, client, url, ctx, _chat("sql", "q3"))
    assert found and found == predicted, (name, found, predicted)
    sql_p = name
    name, found, predicted = await _send(cluster2, client, url, ctx, _chat("chat", "q4"))
    assert (found, predicted) == (0, 0), name
    assert base_p and sql_p
    streams = ctx.kv_index.streams()
    assert sum(s.index.stats.unkeyed for s in streams) == 0
    assert sum(s.index.stats.stored for s in streams) > 0
