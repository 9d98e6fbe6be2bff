"""The fault matrix on fake engines: every mode and every fault, the documented answer
within the configured timeout, and nothing left behind (the cluster fixture then
asserts every slot free and every upstream connection closed).

Timeouts here: prefill 1 s, decode first byte 1 s, idle 1 s. A push D waits for
its KV like a real one (tests/fakes/fake_vllm.py): a P fault leaves it hanging
unless the router closes it. The SIGKILL cases run the faulty engine in its own
process and kill it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from tests.conftest import Cluster, eventually, stream_error
from tests.fakes.router_proc import free_port

MODES = ["pull", "push", "pipelined"]
TIMEOUTS = {"prefill": 1, "decode_first_byte": 1, "idle": 1, "total": 20}
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
IDENTITY = {"engine_id": "e", "kv_host": "127.0.0.1", "kv_port": 5600}

# fault -> (engine role, behaviour, expected: status or "sse_error")
FAULTS: dict[str, tuple[str, dict[str, Any], int | str]] = {
    "p_4xx": ("prefill", {"status": 400}, 400),
    "p_5xx": ("prefill", {"status": 500}, 502),
    "p_hang": ("prefill", {"hang": True}, 504),
    "p_malformed_json": ("prefill", {"malformed_json": True}, 502),
    "p_no_kv_params": ("prefill", {"omit_kv_params": True}, 502),
    "d_4xx": ("decode", {"status": 400}, 400),
    "d_5xx": ("decode", {"status": 503}, 502),
    "d_hang": ("decode", {"hang": True}, 504),
    "d_drop_mid_stream": ("decode", {"drop_after": 2}, "sse_error"),
    "d_stall_mid_stream": ("decode", {"tokens": 4, "token_delay": 3.0}, "sse_error"),
    "d_malformed_sse": ("decode", {"malformed_sse": True}, 200),  # relayed as is
}


def expected_for(mode: str, fault: str, expected: int | str) -> int | str:
    if mode == "pipelined" and fault in ("p_no_kv_params", "p_malformed_json"):
        # P's body carries nothing D needs in pipelined mode, so P "succeeds"; D
        # never gets its KV and the decode first-byte timeout ends it.
        return 504
    return expected


async def router_for(cluster: Cluster, mode: str) -> str:
    extra = IDENTITY if mode != "pull" else {}
    for e in cluster.prefill:
        e.behaviour.transfer_mode = "push" if mode == "push" else "pull"
    url, _ = await cluster.router(
        mode,
        prefill_extra=extra,
        decode_extra=extra,
        timeouts=TIMEOUTS,
        admission={"max_wait": 1},
    )
    return url


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("mode", MODES)
async def test_fault(cluster: Cluster, client: httpx.AsyncClient, mode: str, fault: str) -> None:
    role, behaviour, expected = FAULTS[fault]
    engine = cluster.prefill[0] if role == "prefill" else cluster.decode[0]
    for key, value in behaviour.items():
        setattr(engine.behaviour, key, value)
    url = await router_for(cluster, mode)
    t0 = time.monotonic()
    r = await client.post(url + "/v1/completions", json=BODY)
    elapsed = time.monotonic() - t0
    want = expected_for(mode, fault, expected)
    if want == "sse_error":
        assert r.status_code == 200
        assert stream_error(r.text)["message"]
    else:
        assert r.status_code == want, r.text
        if r.status_code >= 400:
            assert {"message", "type", "code"} <= set(r.json()["error"])
    assert elapsed < 2 * max(TIMEOUTS["prefill"], TIMEOUTS["idle"]) + 1.5


@pytest.mark.parametrize("phase", ["before_prefill_answers", "mid_stream"])
@pytest.mark.parametrize("mode", MODES)
async def test_client_disconnect(cluster: Cluster, mode: str, phase: str) -> None:
    p, d = cluster.prefill[0].behaviour, cluster.decode[0].behaviour
    d.tokens, d.token_delay = 500, 0.01
    if phase == "before_prefill_answers":
        p.delay = 0.6
    url = await router_for(cluster, mode)
    async with httpx.AsyncClient(timeout=10) as c:
        with pytest.raises(TimeoutError):
            async with (
                asyncio.timeout(0.3),
                c.stream("POST", url + "/v1/completions", json=BODY) as r,
            ):
                async for _ in r.aiter_bytes():
                    pass
    # The cluster fixture checks that every leg was closed and every slot freed.
    await eventually(lambda: all(e.active == 0 for e in cluster.engines), timeout=5)


@asynccontextmanager
async def killable_engine(behaviour: dict[str, Any]) -> AsyncIterator[tuple[str, Any]]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.fakes.run_fake",
        str(port),
        json.dumps(behaviour),
    )
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient() as c:
        for _ in range(200):
            try:
                await c.get(url + "/health")
                break
            except httpx.HTTPError:
                await asyncio.sleep(0.05)
    try:
        yield url, proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


@pytest.mark.parametrize("when", ["before_answering", "during_answer"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_engine_killed(
    cluster: Cluster, client: httpx.AsyncClient, role: str, when: str
) -> None:
    behaviour = (
        {"delay": 5.0} if when == "before_answering" else {"tokens": 500, "token_delay": 0.01}
    )
    if role == "prefill" and when == "during_answer":
        behaviour = {"delay": 0.3}  # killed while computing its one token
    async with killable_engine(behaviour) as (engine_url, proc):
        if role == "prefill":
            cluster.prefill_urls = [engine_url]
        else:
            cluster.decode_urls = [engine_url]
        url, ctx = await cluster.router("pull", timeouts=TIMEOUTS)

        async def kill_soon() -> None:
            await asyncio.sleep(0.15)
            os.kill(proc.pid, signal.SIGKILL)

        killer = asyncio.create_task(kill_soon())
        t0 = time.monotonic()
        r = await client.post(url + "/v1/completions", json=BODY)
        await killer
        assert time.monotonic() - t0 < 3
        if role == "decode" and when == "during_answer":
            assert r.status_code == 200 and stream_error(r.text)["message"]
        else:
            assert r.status_code == 502, r.text
        await eventually(lambda: ctx.registry.slots_in_use() == 0)
