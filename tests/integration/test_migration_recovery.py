"""Recovery under live traffic with migration (issue 40): a D killed and restarted while
steady streams run, on deterministic fake engines in processes of their own.

One P and two Ds (pull), each a fake engine process (``tests.fakes.run_fake``) answering as the
deterministic model (each next token a function of the whole sequence, so a continued stream
reproduces an uninterrupted one), ``TOKEN_DELAY`` s a token. Streamed completions start every
``1 / RATE`` s. Once streams are being served and D0 holds at least two of them (the test reads
D0's open requests: the kill lands mid-stream), D0 is SIGKILLed; once the router has taken it
out of rotation it is started again on the same port (the restart), and the load runs on until
D0 is back in rotation and has served a stream again. The figure: the share of streams started
before the restart that ended without an error, D1 healthy throughout. With migration on
(the default ``max_attempts: 2``) every one of them must, each the uninterrupted answer; with it
off (``max_attempts: 0``, the baseline, side by side) the streams D0 held at the kill end with
the error event. Afterwards no slot is held and no engine holds a request.

    pytest tests/integration/test_migration_recovery.py -s   # prints the figures
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest

from router.app import create_app
from router.config import parse_config
from tests.conftest import metric
from tests.fakes.fake_vllm import deterministic_reply, prompt_ids
from tests.fakes.servers import serve
from tests.integration.test_self_healing import EngineProc

pytestmark = pytest.mark.timeout(120)

N = 40  # tokens a stream
TOKEN_DELAY = 0.02  # a stream lasts about N x TOKEN_DELAY
RATE = 10.0  # streams started per second
BODY = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": N, "stream": True}
BEHAVIOUR = {"deterministic": True, "token_delay": TOKEN_DELAY}
WITHIN_S = 30.0  # for each phase to happen (each takes well under a second here)


@dataclass
class Stream:
    started: float
    ended: float
    ok: bool  # ended with [DONE] and no error event
    text: str
    engine: str = ""


def _read(text: str) -> tuple[bool, str]:
    raw = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    if not raw or raw[-1] != "[DONE]":
        return False, ""
    docs = [json.loads(e) for e in raw[:-1]]
    if any("error" in d for d in docs):
        return False, ""
    return True, "".join(c["text"] for d in docs for c in d["choices"])


class Load:
    """Open-loop streams, one every ``1 / RATE`` s, each recorded when it ends."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self._client, self._url = client, url
        self.streams: list[Stream] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            task = asyncio.create_task(self._one())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(1 / RATE)

    async def _one(self) -> None:
        t0 = time.monotonic()
        try:
            r = await self._client.post(self._url + "/v1/completions", json=BODY)
            ok, text = _read(r.text) if r.status_code == 200 else (False, "")
        except httpx.HTTPError:
            ok, text = False, ""
        self.streams.append(Stream(t0, time.monotonic(), ok, text))

    def served(self, since: float = 0.0) -> int:
        return sum(1 for s in self.streams if s.ok and s.started >= since)

    async def until(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WITHIN_S
        while not done():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        self._loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._loop
        await asyncio.gather(*self._tasks)


async def _held(engine: EngineProc) -> int:
    with contextlib.suppress(httpx.HTTPError):
        return await engine.open_requests()
    return 0


@pytest.mark.parametrize("attempts", [2, 0], ids=["migration-on", "migration-off"])
async def test_a_d_restarted_under_steady_streams(attempts: int) -> None:
    p, d0, d1 = (EngineProc(dict(BEHAVIOUR)) for _ in range(3))
    cfg = {
        "models": [
            {
                "name": "tiny",
                "mode": "pull",
                "prefill": [{"url": p.url}],
                "decode": [{"url": d.url, "slots": 16} for d in (d0, d1)],
            }
        ],
        "migration": {"max_attempts": attempts},
    }
    async with contextlib.AsyncExitStack() as stack:
        for e in (p, d0, d1):
            stack.push_async_callback(e.close)
        await asyncio.gather(*(e.start() for e in (p, d0, d1)))
        app = create_app(parse_config(cfg))
        ctx = app.state.ctx
        url = await stack.enter_async_context(serve(app))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=15))
        inst = next(i for i in ctx.registry.instances() if i.url == d0.url)
        load = Load(client, url)
        await load.until(lambda: load.served() >= 8, "the load never ran")
        held = 0
        while held < 2:  # the kill must land on streams D0 is sending
            held = await _held(d0)
        await d0.kill()
        await load.until(lambda: not inst.routable, "D0 never taken out of rotation")
        await d0.start()
        restarted = time.monotonic()
        await load.until(lambda: inst.routable, "D0 never back in rotation")
        rejoined = time.monotonic()
        while await _held(d0) == 0:  # the restarted D0 sends streams again
            assert time.monotonic() - rejoined < WITHIN_S, "D0 never served a stream again"
            await asyncio.sleep(0.02)
        await load.until(lambda: load.served(rejoined) >= 8, "no traffic after the rejoin")
        await load.stop()
        await load.until(lambda: ctx.registry.slots_in_use() == 0, "a slot still held")
        open_requests = [await e.open_requests() for e in (p, d0, d1)]
    before = [s for s in load.streams if s.started < restarted]
    ok = [s for s in before if s.ok]
    share = len(ok) / len(before)
    migrations = metric(ctx, "pdrouter_migrations_total")
    print(
        f"max_attempts {attempts}: {len(ok)} of {len(before)} streams started before the "
        f"restart ended without an error ({share:.1%}); {migrations:g} migrations; "
        f"D0 held {held} at the kill"
    )
    assert open_requests == [0, 0, 0]
    want = "".join(map(chr, deterministic_reply(prompt_ids(BODY), N)))
    assert all(s.text == want for s in load.streams if s.ok)
    if attempts:
        assert share == 1.0, [s for s in before if not s.ok]
        assert migrations >= held
    else:
        assert len(before) - len(ok) >= held
