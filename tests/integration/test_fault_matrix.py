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
import contextlib
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

from tests.conftest import Cluster, client_leaves, eventually, metric, stream_error
from tests.fakes.router_proc import free_port

MODES = ["pull", "push", "pipelined"]
TIMEOUTS = {"prefill": 1, "decode_first_byte": 1, "idle": 1, "total": 20}
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
IDENTITY = {"engine_id": "e", "kv_host": "127.0.0.1", "kv_port": 5600}

# The answer: its status and error code (200 with a code: the stream's SSE error event;
# 200 without: a whole stream).
Expected = tuple[int, str | int | None]
# fault -> (engine role, behaviour, expected answer)
FAULTS: dict[str, tuple[str, dict[str, Any], Expected]] = {
    "p_4xx": ("prefill", {"status": 400}, (400, 400)),  # the engine's own error, as is
    "p_5xx": ("prefill", {"status": 500}, (502, 500)),
    "p_hang": ("prefill", {"hang": True}, (504, "prefill_timeout")),
    "p_malformed_json": ("prefill", {"malformed_json": True}, (502, "kv_transfer_params_missing")),
    "p_no_kv_params": ("prefill", {"omit_kv_params": True}, (502, "kv_transfer_params_missing")),
    "d_4xx": ("decode", {"status": 400}, (400, 400)),
    "d_5xx": ("decode", {"status": 503}, (502, 503)),
    "d_hang": ("decode", {"hang": True}, (504, "decode_first_byte_timeout")),
    "d_drop_mid_stream": ("decode", {"drop_after": 2}, (200, "decode_unreachable")),
    "d_stall_mid_stream": ("decode", {"tokens": 4, "token_delay": 3.0}, (200, "decode_timeout")),
    "d_malformed_sse": ("decode", {"malformed_sse": True}, (200, None)),  # relayed as is
}


def expected_for(mode: str, fault: str, expected: Expected) -> Expected:
    if mode == "pipelined" and fault in ("p_no_kv_params", "p_malformed_json"):
        # P's body carries nothing D needs in pipelined mode, so P "succeeds"; D
        # never gets its KV and the decode first-byte timeout ends it.
        return 504, "decode_first_byte_timeout"
    return expected


async def router_for(cluster: Cluster, mode: str, timeouts: dict[str, float] = TIMEOUTS) -> str:
    extra = IDENTITY if mode != "pull" else {}
    for e in cluster.prefill:
        e.behaviour.transfer_mode = "push" if mode == "push" else "pull"
    url, _ = await cluster.router(
        mode,
        prefill_extra=extra,
        decode_extra=extra,
        timeouts=timeouts,
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
    status, code = expected_for(mode, fault, expected)
    assert r.status_code == status, r.text
    if status >= 400:
        error = r.json()["error"]
        assert {"message", "type", "code"} <= set(error) and error["code"] == code, error
    elif code is not None:
        error = stream_error(r.text)
        assert error["message"] and error["code"] == code, error
    else:
        assert "data: {not json" in r.text and r.text.endswith("data: [DONE]\n\n")
    # Within the configured timeouts (1 s each), measured from the request.
    assert elapsed < 2 * max(TIMEOUTS["prefill"], TIMEOUTS["idle"]) + 1.5


@pytest.mark.parametrize("phase", ["before_prefill_answers", "mid_stream"])
@pytest.mark.parametrize("mode", MODES)
async def test_client_disconnect(cluster: Cluster, mode: str, phase: str) -> None:
    p, d = cluster.prefill[0].behaviour, cluster.decode[0].behaviour
    d.tokens, d.token_delay = 500, 0.01
    # Timeouts far away: whatever ends a leg here is the client's leaving.
    url = await router_for(cluster, mode, {**TIMEOUTS, "prefill": 30, "decode_first_byte": 30})
    if phase == "before_prefill_answers":
        p.gate = asyncio.Event()  # P holds its answer until the client has left
        p_holds = lambda: bool(cluster.prefill[0].received)  # noqa: E731
        await client_leaves(url + "/v1/completions", BODY, p_holds)
        ctx = cluster.routers[-1]
        left = lambda: metric(ctx, "pdrouter_client_disconnects_total", phase="before_first_byte")  # noqa: E731
        await eventually(lambda: left() == 1)  # the router saw it before P answered
        (p_leg,) = cluster.prefill[0].received
        if mode != "push":  # P's leg is aborted at once (push lets P write D's KV first)
            await eventually(lambda: p_leg.closed_by_client)
        p.gate.set()
    else:
        await client_leaves(url + "/v1/completions", BODY)  # once the first bytes came
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
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await c.get(url + "/health")).status_code == 200:
                    break
            assert proc.returncode is None and time.monotonic() < deadline, "no fake engine"
            await asyncio.sleep(0.05)
    try:
        yield url, proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def _open_requests(client: httpx.AsyncClient, engine_url: str) -> int:
    """Generate requests open on a fake engine in another process (its /metrics)."""
    text = (await client.get(engine_url + "/metrics")).text
    (running,) = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running")]
    return int(float(running.split()[-1]))


@pytest.mark.parametrize(
    ("role", "when"),
    # P answers in one piece: killed while it holds the request is killed before it answers.
    [("prefill", "before_answering"), ("decode", "before_answering"), ("decode", "during_answer")],
)
async def test_engine_killed(
    cluster: Cluster, client: httpx.AsyncClient, role: str, when: str
) -> None:
    """SIGKILL while the engine holds the request (P computing its one token, D before its
    first byte) or while D streams: the answer says the engine was lost, at once (the
    timeouts are 30 s here, so no timeout answers in its place)."""
    behaviour: dict[str, Any] = {"tokens": 500, "token_delay": 0.01}  # D streams 5 s
    if when == "before_answering":
        behaviour = {"delay": 30.0}  # holds the request, no answer
    # No timeout can end it first: only the kill does.
    held = {**TIMEOUTS, "prefill": 30, "decode_first_byte": 30, "idle": 30}
    async with killable_engine(behaviour) as (engine_url, proc):
        if role == "prefill":
            cluster.prefill_urls = [engine_url]
        else:
            cluster.decode_urls = [engine_url]
        url, ctx = await cluster.router("pull", timeouts=held)
        if role == "decode" and when == "during_answer":
            async with client.stream("POST", url + "/v1/completions", json=BODY) as r:
                assert r.status_code == 200
                chunks = r.aiter_text()
                text = await anext(chunks)  # D streams
                os.kill(proc.pid, signal.SIGKILL)
                text += "".join([t async for t in chunks])
            assert stream_error(text)["code"] == "decode_unreachable"
        else:
            answer = asyncio.create_task(client.post(url + "/v1/completions", json=BODY))
            deadline = time.monotonic() + 10
            while await _open_requests(client, engine_url) == 0:  # the engine holds it
                assert not answer.done() and time.monotonic() < deadline, answer
                await asyncio.sleep(0.01)
            os.kill(proc.pid, signal.SIGKILL)
            r = await answer
            assert r.status_code == 502 and r.json()["error"]["code"] == f"{role}_unreachable"
        await eventually(lambda: ctx.registry.slots_in_use() == 0)
