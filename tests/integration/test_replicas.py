"""Two router processes sharing two decode engines never oversubscribe them by more
than the stated margin (see router/engines/load.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import httpx

from tests.conftest import Cluster
from tests.fakes.router_proc import router_process

SLOTS = 4
REPLICAS = 2
# The stated margin: (replicas - 1) from splitting free capacity rounded up, plus one
# reservation per other replica still on its way to the engine at report time.
MARGIN = 2 * (REPLICAS - 1)


async def drive(urls: list[str], clients_per_router: int, seconds: float) -> list[int]:
    statuses: list[int] = []
    body = {"model": "tiny", "prompt": "x", "max_tokens": 8, "stream": True}
    stop = time.monotonic() + seconds

    async def loop(c: httpx.AsyncClient, url: str) -> None:
        while time.monotonic() < stop:
            r = await c.post(url + "/v1/completions", json=body)
            statuses.append(r.status_code)

    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as c:
        await asyncio.gather(*(loop(c, u) for u in urls for _ in range(clients_per_router)))
    return statuses


async def run_pair(cluster: Cluster, tmp_path: Path, replicas: int) -> tuple[int, list[int]]:
    for engine in cluster.decode:
        engine.peak = 0
        engine.behaviour.tokens, engine.behaviour.token_delay = 6, 0.05
    cfg = cluster.config(
        "aggregated",
        decode_extra={"slots": SLOTS},
        admission={"replicas": replicas, "max_wait": 20},
        health={"interval": 0.5, "timeout": 1, "load_interval": 0.05},
    )
    async with contextlib.AsyncExitStack() as stack:
        urls = [
            (await stack.enter_async_context(router_process(cfg, tmp_path / f"r{i}.yaml")))[0]
            for i in range(2)
        ]
        statuses = await drive(urls, clients_per_router=3 * SLOTS, seconds=2.0)
    return max(e.peak for e in cluster.decode), statuses


async def test_two_replicas_stay_within_slots_plus_margin(
    cluster2: Cluster, tmp_path: Path
) -> None:
    peak, statuses = await run_pair(cluster2, tmp_path, replicas=REPLICAS)
    assert statuses and set(statuses) == {200}
    assert peak <= SLOTS + MARGIN, peak
    # Positive control: replicas unaware of each other each fill every engine.
    peak_unaware, _ = await run_pair(cluster2, tmp_path, replicas=1)
    assert peak_unaware > SLOTS + MARGIN, peak_unaware
