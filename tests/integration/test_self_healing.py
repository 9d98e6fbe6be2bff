"""Self-healing under live traffic: engines killed and restarted, frozen and thawed, or
fed prompts they reject, while steady traffic flows through a router with the product's
default health, outlier-detection, retry and timeout settings.

Engines are fake vLLM servers, each in its own process (``tests.fakes.run_fake``) so a
test can SIGKILL or SIGSTOP one; a push-mode fake D polls its P's process for "the KV"
as a real D waits for P's WRITE. The timing of every fault is the test's: it sends the
signal, waits for nothing but the process (a killed engine stays dead until the test
restarts it on the same port), and judges each request by when it started relative to
those moments. Measured per scenario: the time from the engine being back until every
request succeeds (bounded by one health interval + the ejection time + 2 s), what the
failing requests were answered and how fast, and that nothing is left behind (no slot
reserved, no request open on any engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from router.app import AppContext, create_app
from router.config import BreakerConfig, HealthConfig, parse_config
from router.engines.breaker import BreakerState
from tests.conftest import Cluster, metric, stream_error
from tests.fakes.router_proc import free_port
from tests.fakes.servers import serve

pytestmark = pytest.mark.timeout(120)

MODES = ["pull", "push"]
ROLES = ["prefill", "decode"]
IDENTITY = {"engine_id": "fake-prefill", "kv_host": "127.0.0.1", "kv_port": 5600}
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
RATE = 8.0  # requests started per second, whatever the answers
DOWN_S = 3.0  # how long a killed engine stays dead
# With the defaults: an engine back is in rotation after its next probe, or when its
# ejection ends, whichever comes first; 2 s for the requests of that moment.
BOUND_S = HealthConfig().interval + BreakerConfig().open_seconds + 2.0
QUIET_S = 3.0  # every request started over this long must succeed to call it recovered
FAST_S = 3.0  # a refused request is answered within this (no queue wait)


class EngineProc:
    """A fake engine in a process of its own, restartable on the same port."""

    def __init__(self, behaviour: dict[str, Any]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.behaviour = behaviour
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.fakes.run_fake", str(self.port), json.dumps(self.behaviour)
        )
        async with httpx.AsyncClient(timeout=1.0) as c:
            deadline = time.monotonic() + 20
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get(self.url + "/health")).status_code == 200:
                        return
                assert time.monotonic() < deadline, f"fake engine on {self.port} did not start"
                await asyncio.sleep(0.02)

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        await self.proc.wait()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    async def open_requests(self) -> int:
        async with httpx.AsyncClient(timeout=5.0) as c:
            text = (await c.get(self.url + "/metrics")).text
        running = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running")]
        return int(float(running[0].split()[-1]))

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            await self.proc.wait()


@dataclass
class Result:
    started: float
    ended: float
    status: int
    ok: bool
    code: str | None = None
    retry_after: str | None = None


@dataclass
class Traffic:
    """Open-loop steady traffic: a streaming completion every ``1 / RATE`` s."""

    client: httpx.AsyncClient
    url: str
    results: list[Result] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _loop: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            task = asyncio.create_task(self._one())
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            await asyncio.sleep(1 / RATE)

    async def _one(self) -> None:
        t0 = time.monotonic()
        try:
            r = await self.client.post(self.url + "/v1/completions", json=BODY)
        except httpx.HTTPError:
            self.results.append(Result(t0, time.monotonic(), 0, False))
            return
        ok = r.status_code == 200 and "[DONE]" in r.text and '{"error"' not in r.text
        code = r.json()["error"]["code"] if r.status_code >= 400 else None
        if r.status_code == 200 and not ok:  # a stream cut after its first bytes
            try:
                code = stream_error(r.text)["code"]
            except (AssertionError, ValueError, KeyError):
                code = "broken_stream"  # not ended as vLLM ends a failed stream
        res = Result(t0, time.monotonic(), r.status_code, ok, code, r.headers.get("retry-after"))
        self.results.append(res)

    async def stop(self) -> None:
        assert self._loop is not None
        self._loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._loop
        await asyncio.gather(*self.tasks)

    def served_since(self, since: float) -> int:
        """Requests started at ``since`` or later that succeeded."""
        return sum(1 for r in self.results if r.ok and r.started >= since)

    async def until(self, done: Callable[[], bool], what: str, within: float = 20.0) -> None:
        """Wait (the traffic going on) until ``done()``; fails after ``within`` seconds."""
        deadline = time.monotonic() + within
        while not done():
            assert time.monotonic() < deadline, f"{what}\n{self.describe(0.0)}"
            await asyncio.sleep(0.05)

    async def flowing(self, since: float = 0.0, n: int = 4) -> None:
        """Until ``n`` requests started at ``since`` or later have succeeded."""
        await self.until(lambda: self.served_since(since) >= n, f"{n} requests not served")

    def recovered_at(self, since: float) -> float:
        """The start of the first request after which every request started since
        ``since`` succeeded (``since`` if none failed). Call after :meth:`stop`."""
        done = sorted((r for r in self.results if r.started >= since), key=lambda r: r.started)
        failed = [r.started for r in done if not r.ok]
        if not failed:
            return since
        after = [r.started for r in done if r.started > failed[-1]]
        assert after, self.describe(since)
        return after[0]

    async def run_until_quiet(self, since: float) -> None:
        """Keep the traffic going until QUIET_S have passed with no failure seen
        among requests started since ``since``, then stop it (all requests end)."""
        deadline = since + BOUND_S + QUIET_S + 5
        while True:
            failed = [r.started for r in self.results if r.started >= since and not r.ok]
            if time.monotonic() - max(failed, default=since) >= QUIET_S:
                break
            assert time.monotonic() < deadline, self.describe(since)
            await asyncio.sleep(0.25)
        await self.stop()

    def describe(self, since: float) -> str:
        rows = [
            f"{r.started - since:+.2f}s {r.status} {r.code} ok={r.ok} {r.ended - r.started:.2f}s"
            for r in sorted(self.results, key=lambda r: r.started)
        ]
        return "no recovery:\n" + "\n".join(rows[-80:])


@dataclass
class Rig:
    prefill: list[EngineProc]
    decode: list[EngineProc]
    url: str
    ctx: AppContext
    traffic: Traffic

    def engines(self, role: str) -> list[EngineProc]:
        return self.prefill if role == "prefill" else self.decode


@contextlib.asynccontextmanager
async def rig(mode: str, n_prefill: int, n_decode: int) -> AsyncIterator[Rig]:
    token = {"tokens": 8, "token_delay": 0.02, "transfer_mode": mode}
    prefill = [EngineProc(dict(token)) for _ in range(n_prefill)]
    decode = [EngineProc({**token, "kv_peer": prefill[0].url}) for _ in range(n_decode)]
    if mode == "push":
        assert n_prefill == 1, "a push fake D polls one P"
    extra = IDENTITY if mode == "push" else {}
    cfg = {
        "models": [
            {
                "name": "tiny",
                "mode": mode,
                "prefill": [{"url": p.url, **extra} for p in prefill],
                "decode": [{"url": d.url, "slots": 16} for d in decode],
            }
        ],
    }
    async with contextlib.AsyncExitStack() as stack:
        for e in (*prefill, *decode):
            stack.push_async_callback(e.close)
        await asyncio.gather(*(e.start() for e in (*prefill, *decode)))
        app = create_app(parse_config(cfg))
        url = await stack.enter_async_context(serve(app))
        # A request longer than this is a failure here anyway (a healthy one takes < 1 s).
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=15))
        traffic = Traffic(client, url)
        yield Rig(prefill, decode, url, app.state.ctx, traffic)
        await _assert_nothing_left(Rig(prefill, decode, url, app.state.ctx, traffic))


async def _assert_nothing_left(r: Rig) -> None:
    deadline = time.monotonic() + 10
    while True:
        open_ = [await e.open_requests() for e in (*r.prefill, *r.decode)]
        slots = r.ctx.registry.slots_in_use()
        if slots == 0 and not any(open_):
            break
        assert time.monotonic() < deadline, f"slots {slots}, engine requests {open_}"
        await asyncio.sleep(0.1)
    assert metric(r.ctx, "pdrouter_queue_depth") == 0


async def _kill_and_restart(
    engine: EngineProc, traffic: Traffic, out: Callable[[float], bool]
) -> tuple[float, float]:
    """Once traffic is served: SIGKILL; once the router has taken the engine out of
    rotation (``out(killed)``), and DOWN_S after the kill (the outage the scenario
    measures), restart on the same port. Returns when it was killed and when it was back
    (listening again)."""
    await traffic.flowing()
    killed = time.monotonic()
    await engine.kill()
    await traffic.until(lambda: out(killed), "the dead engine was never taken out of rotation")
    await asyncio.sleep(max(0.0, killed + DOWN_S - time.monotonic()))  # the outage's length
    await engine.start()
    return killed, time.monotonic()


def _failures(results: list[Result], after: float) -> list[Result]:
    return [r for r in results if not r.ok and r.started >= after]


# -- an engine that is the only one of its role -----------------------------------------


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("mode", MODES)
async def test_sole_engine_killed_and_restarted(mode: str, role: str) -> None:
    """While the only engine of a role is dead, requests fail fast (502 for the first
    ones, then 503 naming the role with a Retry-After); once it is back, every request
    succeeds within the bound."""
    refused = f"no_healthy_{role}"

    def ejected(killed: float) -> bool:  # the router refuses at once, naming the role
        return any(x.code == refused and x.started >= killed for x in r.traffic.results)

    async with rig(mode, 1, 1) as r:
        r.traffic.start()
        killed, back = await _kill_and_restart(r.engines(role)[0], r.traffic, ejected)
        await r.traffic.run_until_quiet(back)
    results = r.traffic.results
    recovered = r.traffic.recovered_at(back)
    print(f"{mode} {role} killed: recovered {recovered - back:.2f}s after the restart")
    assert recovered - back <= BOUND_S
    # Judged by when they ended, not started: on a loaded machine a request started well
    # before the kill may still be in flight on the engine when it dies.
    assert all(x.ok for x in results if x.ended < killed), "failed before the kill"
    # Requests in flight at the kill may fail any way the kill breaks them (a push D whose
    # P died may wait for its KV until the client gives up); those sent later fail fast,
    # and say why.
    for x in _failures(results, killed):
        assert x.ended - x.started < FAST_S, x  # no request waits for a slot
        if x.status == 503:  # the engine out of rotation: refused at once
            assert x.code == refused and x.retry_after, x
        else:  # the first ones: the call to the dead engine failed
            assert (x.status, x.code) == (502, f"{role}_unreachable"), x


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("mode", MODES)
async def test_sole_engine_frozen_and_thawed(mode: str, role: str) -> None:
    """A short freeze (SIGSTOP, shorter than the health checks' verdict) delays the
    requests of that moment and fails none of them."""
    async with rig(mode, 1, 1) as r:
        engine = r.engines(role)[0]
        r.traffic.start()
        await r.traffic.flowing()
        engine.signal(signal.SIGSTOP)
        frozen = time.monotonic()
        await asyncio.sleep(DOWN_S)  # the freeze the scenario measures
        engine.signal(signal.SIGCONT)
        back = time.monotonic()
        await r.traffic.run_until_quiet(back)
    assert [x for x in r.traffic.results if not x.ok] == []
    # The freeze held requests (started while frozen, answered after the thaw), and failed none.
    assert any(frozen <= x.started and x.ended > back for x in r.traffic.results)


# -- one engine of two ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "role"), [("pull", "prefill"), ("pull", "decode"), ("push", "decode")]
)
async def test_one_of_two_killed_no_clean_request_fails(mode: str, role: str) -> None:
    """With a healthy engine of each role left, no request started after the kill
    fails; the killed one is back in rotation within the bound after its restart.
    (Push: one fake P, which every fake D polls for its KV.)"""
    n_prefill, n_decode = (2, 1) if role == "prefill" else (1, 2)
    async with rig(mode, n_prefill, n_decode) as r:
        engine = r.engines(role)[0]
        inst = next(i for i in r.ctx.registry.instances() if i.url == engine.url)
        r.traffic.start()
        killed, back = await _kill_and_restart(engine, r.traffic, lambda _: not inst.routable)
        deadline = back + BOUND_S
        while not (inst.breaker.state is BreakerState.CLOSED and inst.healthy):
            assert time.monotonic() < deadline, f"{inst} not back: {inst.breaker.state}"
            await asyncio.sleep(0.1)
        rejoined = time.monotonic()
        await r.traffic.flowing(since=rejoined)  # traffic after the rejoin
        await r.traffic.stop()
    print(f"{mode} {role} 1 of 2 killed: back in rotation {rejoined - back:.2f}s after restart")
    assert _failures(r.traffic.results, killed + 0.05) == []


# -- bad prompts ------------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("mode", MODES)
async def test_poisoned_prompts_never_eject_the_only_engine(
    cluster: Cluster, mode: str, role: str
) -> None:
    """An ``openai`` SDK client (default retries: each call sends its request up to
    three times) sends prompts the engine answers 500 to, amid clean traffic: every
    clean request succeeds, every bad one gets the engine's error, none a 503."""
    engine = cluster.prefill[0] if role == "prefill" else cluster.decode[0]
    engine.behaviour.poison = "POISON"
    for e in cluster.prefill:
        e.behaviour.transfer_mode = mode
    extra = IDENTITY if mode == "push" else {}
    url, ctx = await cluster.router(
        mode, prefill_extra=extra, retries={"max_attempts": 2}, health_checks=True
    )
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
    async with httpx.AsyncClient(timeout=30) as client:
        traffic = Traffic(client, url)
        traffic.start()

        async def poisoned() -> tuple[int, object]:
            with pytest.raises(openai.APIStatusError) as info:
                await sdk.completions.create(model="tiny", prompt="POISON", max_tokens=4)
            return info.value.status_code, info.value.code

        # A burst: the bad answers come in a row, between few clean ones.
        statuses = await asyncio.gather(*(poisoned() for _ in range(4)))
        await traffic.flowing(since=time.monotonic(), n=8)  # clean traffic after the burst
        await traffic.stop()
    await sdk.close()
    assert statuses == [(502, "500")] * 4  # the engine's own 500, each time (the SDK's str)
    assert [x for x in traffic.results if not x.ok] == []
    assert len(traffic.results) >= 4
    assert metric(ctx, "pdrouter_breaker_state", role=role) == 0


# -- a hung engine ----------------------------------------------------------------------


async def test_a_hung_prefill_costs_the_health_verdict_not_the_timeout() -> None:
    """P frozen with a request inside and the default 120 s prefill timeout: the
    request is answered once the health checks find P unhealthy, and the next ones
    are refused at once until P is back."""
    async with rig("pull", 1, 1) as r:
        health = HealthConfig()
        p = r.prefill[0]
        p.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=60) as c:
            hung = await c.post(r.url + "/v1/completions", json=BODY)
            took = time.monotonic() - t0
            refused = await c.post(r.url + "/v1/completions", json=BODY)
            p.signal(signal.SIGCONT)
            deadline = time.monotonic() + BOUND_S
            while (await c.post(r.url + "/v1/completions", json=BODY)).status_code != 200:
                assert time.monotonic() < deadline, "P not back"
                await asyncio.sleep(0.2)
    assert hung.status_code == 504 and hung.json()["error"]["code"] == "prefill_unhealthy"
    # Probes every interval, each allowed its timeout, unhealthy after so many misses.
    verdict = health.unhealthy_after * (health.interval + health.timeout)
    assert took <= verdict + 2.0, took
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "no_healthy_prefill"
