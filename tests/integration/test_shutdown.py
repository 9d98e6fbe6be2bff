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


@pytest.mark.parametrize(("tokens", "finishes"), [(20, True), (400, False)])
async def test_sigterm_drains_then_closes(
    cluster: Cluster, tmp_path: Path, tokens: int, finishes: bool
) -> None:
    d = cluster.decode[0].behaviour
    d.tokens, d.token_delay = tokens, 0.025  # 0.5 s or 10 s of streaming
    cfg = cluster.config("pull")
    async with router_process(cfg, tmp_path / "r.yaml", grace=2.0) as (url, proc):
        stream = asyncio.create_task(stream_all(url))
        await eventually(lambda: cluster.decode[0].active == 1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient() as c:
                await c.get(url + "/health")
        text = await stream
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        elapsed = time.monotonic() - t0
    assert text.rstrip().endswith("[DONE]")  # vLLM's end of a stream, failed or not
    assert ('"code":"shutting_down"' in text) is not finishes
    if not finishes:  # the error event comes just before the end
        assert text.rstrip().split("\n\n")[-2].startswith('data: {"error"')
    if not finishes:
        assert 1.5 < elapsed < 6  # the grace period, then the stream was cut
    await eventually(lambda: cluster.decode[0].active == 0)
