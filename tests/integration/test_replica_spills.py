"""Router replicas spill a session alike: session affinity's load bound is judged from what the
engines report (router/engines/reported.py), not from each replica's own counts, so a replica
that holds no request places a session where the busy one would."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx

from router.app import AppContext, create_app
from router.config import parse_config
from router.engines.affinity import Placement, _rank
from router.engines.instance import Role
from tests.conftest import Cluster, eventually
from tests.fakes.servers import serve


def _sessions_first_on(url: str, other: str, count: int) -> list[str]:
    """Session ids whose rendezvous order puts ``url`` before ``other``."""
    found = []
    for i in range(1000):
        key = f"s{i}"
        if _rank(key, url) > _rank(key, other):
            found.append(key)
        if len(found) == count:
            return found
    raise AssertionError("not enough session ids")


async def _replica(cluster: Cluster, replicas: int) -> tuple[str, AppContext]:
    cfg = cluster.config(
        "aggregated",
        decode_extra={"slots": 8},
        admission={"replicas": replicas},
        model={"sessions": {"spill_at": 0.25}},  # room while load + 1 <= floor(0.25 x 8) = 2
        health={"interval": 60, "load_interval": 3600},  # loads read when the test says
    )
    app = create_app(parse_config(cfg), health_checks=False)
    url = await cluster.stack.enter_async_context(serve(app))
    ctx: AppContext = app.state.ctx
    cluster.routers.append(ctx)
    return url, ctx


async def _where(
    cluster: Cluster,
    client: httpx.AsyncClient,
    url: str,
    session: str,
    pending: list[asyncio.Task[Any]],
) -> str:
    """The D a request of ``session`` lands on (its answer held until the end of the test)."""
    body = {"model": "tiny", "prompt": f"hello from {session}", "max_tokens": 2, "stream": True}
    task = asyncio.create_task(
        client.post(url + "/v1/completions", json=body, headers={"x-session-id": session})
    )
    pending.append(task)
    await eventually(
        lambda: any(session in str(r.body) for d in cluster.decode for r in d.received)
    )
    return next(d.name for d in cluster.decode for r in d.received if session in str(r.body))


async def test_a_replica_spills_a_session_where_the_busy_replica_would(
    cluster2: Cluster, client: httpx.AsyncClient
) -> None:
    gate = asyncio.Event()  # every answer held: the streams stay on their D
    for d in cluster2.decode:
        d.behaviour.gate = gate
    busy_url, busy = await _replica(cluster2, replicas=2)
    idle_url, idle = await _replica(cluster2, replicas=2)
    blind_url, _ = await _replica(cluster2, replicas=1)  # its own counts only: today's rule
    d0, d1 = cluster2.decode_urls
    sessions = _sessions_first_on(d0, d1, 4)
    pending: list[asyncio.Task[Any]] = []
    try:
        # The busy replica puts two sessions on D0, which then has no room for a third
        # (2 + 1 > 2): it would spill one first on D0 to D1.
        assert [await _where(cluster2, client, busy_url, s, pending) for s in sessions[:2]] == [
            "d0"
        ] * 2
        pool = busy.registry.get("tiny")
        assert pool is not None
        would, how = pool.affinity.select(Role.DECODE, sessions[2], pool.decode)
        assert (would.url, how) == (d1, Placement.SPILLED)
        # The idle replica holds nothing, and places that session the same, from the reports.
        assert idle.engine_loads is not None
        await idle.engine_loads.read_all(idle.registry.instances())
        assert await _where(cluster2, client, idle_url, sessions[2], pending) == "d1"
        # A replica that counts only its own requests sees D0 empty: it disagrees.
        assert await _where(cluster2, client, blind_url, sessions[3], pending) == "d0"
    finally:
        gate.set()
        with contextlib.suppress(Exception):
            await asyncio.gather(*pending)
