"""Graceful shutdown: on SIGTERM the router stops accepting, lets open streams finish
up to the grace period, then closes them (and their upstream legs) and exits 0."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import Cluster, eventually
from tests.fakes.router_proc import router_process

BODY = {"model": "tiny", "prompt": "x", "max_tokens": 8, "stream": True}


async def stream_all(url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(url + "/v1/completions", json=BODY)
        return r.text


async def refused(url: str) -> bool:
    """True once the router accepts no connection any more (a connection caught while the
    listener closes, dropped unanswered or reset mid-read, proves neither: ask again)."""
    try:
        async with httpx.AsyncClient() as c:
            await c.get(url + "/health")
    except httpx.ConnectError:
        return True
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return False
    return False


@pytest.mark.parametrize("finishes", [True, False])
async def test_sigterm_drains_then_closes(cluster: Cluster, tmp_path: Path, finishes: bool) -> None:
    """A stream that ends within the grace period (D holds the end of its stream until the
    router stopped accepting) finishes whole; one that would not (10 s of streaming against
    2 s of grace) is cut at the grace with the shutdown error."""
    engine = cluster.decode[0]
    d = engine.behaviour
    if finishes:
        d.end_gate = asyncio.Event()
    else:
        d.tokens, d.token_delay = 400, 0.025
    cfg = cluster.config("pull")
    async with router_process(cfg, tmp_path / "r.yaml", grace=2.0) as (url, proc):
        stream = asyncio.create_task(stream_all(url))
        await eventually(lambda: engine.active == 1)
        if finishes:
            await asyncio.wait_for(engine.holding_end.wait(), 10)  # mid-stream, held
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        deadline = t0 + 10
        while not await refused(url):  # it stops accepting...
            assert time.monotonic() < deadline, "still accepting after SIGTERM"
            await asyncio.sleep(0.02)
        assert not stream.done()  # ...while the stream goes on
        if d.end_gate is not None:
            d.end_gate.set()
        text = await stream
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        elapsed = time.monotonic() - t0
    assert text.rstrip().endswith("[DONE]")  # vLLM's end of a stream, failed or not
    assert ('"code":"shutting_down"' in text) is not finishes
    if not finishes:  # the error event comes just before the end
        assert text.rstrip().split("\n\n")[-2].startswith('data: {"error"')
    if not finishes:
        # the grace period, then the cut: well before the 10 s the stream would have taken
        assert 1.5 < elapsed < 8.5
    await eventually(lambda: cluster.decode[0].active == 0)
