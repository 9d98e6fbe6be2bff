"""Data-parallel engines (``data_parallel_size``): each rank behind one URL is an engine of its
own. Fake ``vllm serve --data-parallel-size 2`` P and D (tests/fakes/fake_dp.py) on real
sockets: in every mode each leg carries ``X-data-parallel-rank`` and lands on that rank, push
and pipelined name the other side's rank (``<engine_id>_dp<r>``, its side-channel port), and
decode slots are counted per rank."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from router.app import create_app
from router.config import parse_config
from tests.conftest import Cluster, assert_nothing_leaked, eventually, metric
from tests.fakes.fake_dp import FakeDPEngine
from tests.fakes.fake_vllm import KvBus
from tests.fakes.servers import serve

STREAM = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "stream": True}
P_ID, P_HOST, P_PORT = "P", "10.0.0.1", 7000
D_ID, D_HOST, D_PORT = "D", "10.0.0.2", 8000
SLOTS = 2  # per rank


@dataclass
class DP:
    cluster: Cluster
    p: FakeDPEngine
    d: FakeDPEngine


@pytest.fixture
async def dp() -> AsyncIterator[DP]:
    bus = KvBus()
    async with contextlib.AsyncExitStack() as stack:
        p = FakeDPEngine("p", 2, bus, engine_id=P_ID, kv_port=P_PORT)
        d = FakeDPEngine("d", 2, bus, engine_id=D_ID, kv_port=D_PORT)
        p_url = await stack.enter_async_context(serve(p))
        d_url = await stack.enter_async_context(serve(d))
        cluster = Cluster(p.ranks, d.ranks, [p_url], [d_url], stack)
        yield DP(cluster, p, d)
        await assert_nothing_leaked(cluster)


def _extras(tp: int = 1) -> dict[str, dict[str, object]]:
    return {
        "prefill_extra": {
            "data_parallel_size": 2,
            "engine_id": P_ID,
            "kv_host": P_HOST,
            "kv_port": P_PORT,
        },
        "decode_extra": {
            "data_parallel_size": 2,
            "slots": SLOTS,
            "engine_id": D_ID,
            "kv_host": D_HOST,
            "kv_port": D_PORT,
            "tp_size": tp,
        },
    }


def _assert_pinned(engine: FakeDPEngine) -> None:
    """Every request a rank got named that rank; none went to the server's own balancer."""
    for rank, fake in enumerate(engine.ranks):
        for rec in fake.received:
            assert rec.headers.get("x-data-parallel-rank") == str(rank), (engine.name, rank)
    assert engine.unpinned == 0 and engine.refused == []


@pytest.mark.parametrize("mode", ["pull", "push", "push-sequential", "pipelined", "aggregated"])
async def test_every_leg_lands_on_the_rank_chosen_and_names_the_peer_rank(
    dp: DP, client: httpx.AsyncClient, mode: str
) -> None:
    for fake in dp.p.ranks:
        fake.behaviour.transfer_mode = "push" if mode.startswith("push") else "pull"
    release = asyncio.Event()
    for fake in dp.d.ranks:
        fake.hold_done = lambda rec: release  # every stream held open before its [DONE]
    url, ctx = await dp.cluster.router(mode, **_extras())
    pool = ctx.registry.get("tiny")
    assert pool is not None
    assert [i.key for i in pool.decode] == [f"{dp.cluster.decode_urls[0]}#dp{r}" for r in (0, 1)]

    held = [asyncio.create_task(client.post(url + "/v1/completions", json=STREAM)) for _ in "1234"]
    try:
        # Two slots per rank: four streams take both ranks' slots, two each, ...
        await eventually(lambda: [f.active for f in dp.d.ranks] == [SLOTS, SLOTS])
        for rank in ("0", "1"):
            assert metric(ctx, "pdrouter_decode_slots_in_use", rank=rank) == SLOTS
            assert metric(ctx, "pdrouter_decode_slots", rank=rank) == SLOTS
        # ... and a fifth waits for one, though the URL's engine has four more cores' worth.
        fifth = asyncio.create_task(client.post(url + "/v1/completions", json=STREAM))
        held.append(fifth)
        await eventually(lambda: pool.ledger.queue_depth == 1)
        assert sum(len(f.received) for f in dp.d.ranks) == 4
    finally:
        release.set()
    answers = await asyncio.gather(*held)
    assert all(a.status_code == 200 and a.text.endswith("data: [DONE]\n\n") for a in answers)

    _assert_pinned(dp.d)
    _assert_pinned(dp.p)
    d_legs = [(rank, rec) for rank, f in enumerate(dp.d.ranks) for rec in f.received]
    assert len(d_legs) == 5
    if mode == "aggregated":
        assert all(not f.received for f in dp.p.ranks)
        return
    for d_rank, d_req in d_legs:
        p_rank = dp.p.rank_of(d_req.request_id)
        assert p_rank is not None
        # D reads from (pull), or is written by (push, pipelined), P's rank that computed it.
        assert d_req.kv["remote_engine_id"] == f"{P_ID}_dp{p_rank}"
        assert d_req.kv["remote_port"] == P_PORT + p_rank
        if mode == "pipelined":
            (p_req,) = [r for r in dp.p.ranks[p_rank].received if r.request_id == d_req.request_id]
            assert p_req.kv["remote_engine_id"] == f"{D_ID}_dp{d_rank}"
            assert (p_req.kv["remote_host"], p_req.kv["remote_port"]) == (D_HOST, D_PORT + d_rank)


async def test_pipelined_rank_ports_step_by_the_rank_s_workers(
    dp: DP, client: httpx.AsyncClient
) -> None:
    """This project's connector gives each worker of a rank a port: rank r of a TP 2 D
    listens from its base port + 2r (connector/metadata.py, ``engine_address``)."""
    url, _ = await dp.cluster.router("pipelined", **_extras(tp=2))
    for _ in range(4):
        r = await client.post(url + "/v1/completions", json={**STREAM, "stream": False})
        assert r.status_code == 200
    _assert_pinned(dp.p)
    _assert_pinned(dp.d)
    for p_rank, fake in enumerate(dp.p.ranks):
        for p_req in fake.received:
            d_rank = dp.d.rank_of(p_req.request_id)
            assert d_rank is not None
            assert p_req.kv["remote_engine_id"] == f"{D_ID}_dp{d_rank}"
            assert p_req.kv["remote_port"] == D_PORT + 2 * d_rank
            (d_req,) = [r for r in dp.d.ranks[d_rank].received if r.request_id == p_req.request_id]
            assert d_req.kv["remote_port"] == P_PORT + p_rank


async def test_push_learns_each_rank_s_identity_from_that_rank(
    dp: DP, client: httpx.AsyncClient
) -> None:
    """Without a configured identity, push learns P's from P's answers: each rank's own, as
    each answer came from the rank the router pinned."""
    for fake in dp.p.ranks:
        fake.behaviour.transfer_mode = "push"
    url, ctx = await dp.cluster.router(
        "push",
        prefill_extra={"data_parallel_size": 2},
        decode_extra={"data_parallel_size": 2},
        model={"policy": {"prefill": "round_robin"}},
    )
    for _ in range(6):
        r = await client.post(url + "/v1/completions", json={**STREAM, "stream": False})
        assert r.status_code == 200
    _assert_pinned(dp.p)
    pool = ctx.registry.get("tiny")
    assert pool is not None
    assert all(fake.received for fake in dp.p.ranks)
    for rank, inst in enumerate(pool.prefill):
        assert inst.nixl is not None
        assert (inst.nixl.engine_id, inst.nixl.port) == (f"{P_ID}_dp{rank}", P_PORT + rank)
    for fake in dp.d.ranks:
        for d_req in fake.received:
            p_rank = dp.p.rank_of(d_req.request_id)
            assert d_req.kv["remote_engine_id"] == f"{P_ID}_dp{p_rank}"


async def test_sessions_stick_to_a_rank(dp: DP, client: httpx.AsyncClient) -> None:
    """A session's P and D are ranks, not URLs: its turns stay on the same rank of each."""
    url, _ = await dp.cluster.router("pull", model={"sessions": {"enabled": True}}, **_extras())
    for session in "abcd":
        for turn in range(3):
            r = await client.post(
                url + "/v1/completions",
                json={**STREAM, "stream": False, "prompt": f"{session} {turn}"},
                headers={"x-session-id": session},
            )
            assert r.status_code == 200
    _assert_pinned(dp.p)
    _assert_pinned(dp.d)
    for engine in (dp.p, dp.d):
        for session in "abcd":
            ranks = {
                rank
                for rank, fake in enumerate(engine.ranks)
                for rec in fake.received
                if str(rec.body["prompt"]).startswith(session)
            }
            assert len(ranks) == 1, (engine.name, session, ranks)


async def test_the_fake_answers_like_vllm_s_api_server(dp: DP, client: httpx.AsyncClient) -> None:
    """What the router's header relies on: a rank in range is honoured, one out of range is
    vLLM's 400, none (or not a number) leaves the choice to the server's balancer."""
    base = dp.cluster.decode_urls[0] + "/v1/completions"
    body = {**STREAM, "stream": False}
    r = await client.post(base, json=body, headers={"x-data-parallel-rank": "1"})
    assert r.status_code == 200 and len(dp.d.ranks[1].received) == 1
    r = await client.post(base, json=body, headers={"x-data-parallel-rank": "2"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "data_parallel_rank 2 is out of range [0, 2)."
    r = await client.post(base, json=body, headers={"x-data-parallel-rank": "x"})
    assert r.status_code == 200 and dp.d.unpinned == 1
    text = (await client.get(dp.cluster.decode_urls[0] + "/metrics")).text
    assert 'engine="0"' in text and 'engine="1"' in text


@pytest.mark.parametrize(
    ("entry", "mode", "message"),
    [
        ({"data_parallel_size": 0}, "pull", "greater than or equal to 1"),
        ({"data_parallel_size": 65}, "pull", "less than or equal to 64"),
        (
            {"data_parallel_size": 4, "engine_id": "e", "kv_host": "h", "kv_port": 65534},
            "push",
            "no side-channel port for data-parallel rank 3",
        ),
        (
            {"data_parallel_size": 2, "kv_events_endpoint": "ipc:///run/kv"},
            "pull",
            "must be tcp:// with data_parallel_size above 1",
        ),
        (
            {"data_parallel_size": 2},
            "pull",
            "must be at least data_parallel_size (2) apart",
        ),
    ],
)
def test_bad_data_parallel_entries_are_refused(
    entry: dict[str, object], mode: str, message: str
) -> None:
    from router.config import ConfigError

    cfg = {
        "models": [
            {
                "name": "tiny",
                "mode": mode,
                "kv_events": {"enabled": True},
                "prefill": [{"url": "http://p:8000", **entry}],
                "decode": [{"url": "http://d:8000"}],
            }
        ]
    }
    with pytest.raises(ConfigError) as err:
        parse_config(cfg)
    assert message in str(err.value)


async def test_a_retry_skips_every_rank_of_a_url_nothing_listens_on(
    dp: DP, client: httpx.AsyncClient
) -> None:
    """A refused connection says the API server is gone, and with it all its ranks: no retry
    is spent on the next rank behind the same dead URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    cfg = dp.cluster.config("pull", retries={"max_attempts": 3})
    cfg["models"][0]["prefill"] = [{"url": dead, "data_parallel_size": 2}]
    app = create_app(parse_config(cfg), health_checks=False)
    url = await dp.cluster.stack.enter_async_context(serve(app))
    ctx = app.state.ctx
    dp.cluster.routers.append(ctx)
    r = await client.post(url + "/v1/completions", json={**STREAM, "stream": False})
    assert r.status_code == 502, r.text
    assert metric(ctx, "pdrouter_retries_total") == 0
    assert metric(ctx, "pdrouter_upstream_errors_total") == 1
    assert all(not f.received for f in dp.d.ranks)
