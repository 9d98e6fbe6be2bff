"""Two router processes sharing two decode engines never oversubscribe them by more
than the stated margin (see router/workers/load.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.conftest import Cluster

SLOTS = 4
REPLICAS = 2
# The stated margin: (replicas - 1) from splitting free capacity rounded up, plus one
# reservation per other replica still on its way to the engine at report time.
MARGIN = 2 * (REPLICAS - 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def router_process(cfg: dict[str, Any], path: Path) -> AsyncIterator[str]:
    port = free_port()
    path.write_text(yaml.safe_dump({**cfg, "listen": {"host": "127.0.0.1", "port": port}}))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router",
        "serve",
        "--config",
        str(path),
        "--grace",
        "1",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as c:
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get(url + "/ready")).status_code == 200:
                        break
                assert proc.returncode is None, await proc.stderr.read()  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "router did not become ready"
                await asyncio.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


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
            await stack.enter_async_context(router_process(cfg, tmp_path / f"r{i}.yaml"))
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
