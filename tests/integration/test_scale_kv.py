"""Four router replicas over eight P and eight D (fake engines publishing KV events), the turns
of each conversation sent to the replicas in turn, in pipelined mode with kept turns: each
replica routes by what the engines report (their KV events and their load), so none needs what
another saw.

Checked, turn by turn (from each conversation's second turn): the P and the D chosen hold the
conversation's prefix in their cache, and P is offered the previous turn kept on its D,
whichever replica serves the turn; with one stream per conversation held open (steady load),
every D carries as many as the others. Half-way, one replica is replaced by a fresh one: once
its replay has filled its index it routes as the others. The test decides every timing: each
request is sent once the serving replica has applied every KV event the engines published and
has read the engines' load, so the outcome does not depend on scheduling.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from router.app import AppContext, create_app
from router.config import parse_config
from router.pd.kept_turns import keep_id
from tests.fakes.fake_vllm import FakeEngine, KvBus, Received
from tests.fakes.kv_cluster import events_config, synced, with_events
from tests.fakes.servers import serve

REPLICAS, ENGINES, CONVERSATIONS, TURNS = 4, 8, 48, 5
RESTART_AFTER = 3  # turns: then replica 2 is replaced by a fresh one
BS = 16
SYSTEM = "You are a helpful assistant. Answer briefly and kindly."  # shared by every one
# Each conversation's own opening: long enough (about 1,500 tokens of the fake tokenizer) that
# what a D holds of it outweighs a few streams of load (load_cost_tokens 256 each).
OPENING = "a long question about its own subject, " * 40


def _messages(conv: int, turn: int) -> list[dict[str, str]]:
    reply = "".join(f"t{i} " for i in range(8))  # what the fake D answers (8 tokens)
    history = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"conversation {conv:03d} opens with {OPENING}"},
    ]
    for t in range(turn):
        history += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"follow-up {t} of conversation {conv:03d}"},
        ]
    return history


@dataclass
class Scale:
    prefill: list[FakeEngine]
    decode: list[FakeEngine]
    urls: dict[str, FakeEngine]
    stack: contextlib.AsyncExitStack
    config: dict[str, Any] = field(default_factory=dict)
    replicas: list[tuple[str, AppContext, contextlib.AsyncExitStack]] = field(default_factory=list)

    @property
    def engines(self) -> list[FakeEngine]:
        return [*self.prefill, *self.decode]

    async def start_replica(self) -> tuple[str, AppContext, contextlib.AsyncExitStack]:
        own = contextlib.AsyncExitStack()
        app = create_app(parse_config(self.config), health_checks=False)
        url = await own.enter_async_context(serve(app))
        return url, app.state.ctx, own


async def _serve_all(apps: list[Any], stack: contextlib.AsyncExitStack) -> list[str]:
    """Serve every app; ``stack`` stops them all at once (a server takes 0.2 s to stop)."""
    servers = [serve(app) for app in apps]
    urls = [await server.__aenter__() for server in servers]

    async def stop() -> None:
        await asyncio.gather(*(server.__aexit__(None, None, None) for server in servers))

    stack.push_async_callback(stop)
    return urls


@contextlib.asynccontextmanager
async def scale() -> AsyncIterator[Scale]:
    bus = KvBus()
    async with contextlib.AsyncExitStack() as stack:
        engines = [FakeEngine(f"{r}{i}", bus) for r in "pd" for i in range(ENGINES)]
        urls = dict(zip(await _serve_all(engines, stack), engines, strict=True))
        await with_events(engines, stack)
        for e in engines:
            e.behaviour.tokens = 8
        by_name = {e.name: u for u, e in urls.items()}
        model = {
            "name": "tiny",
            "mode": "pipelined",
            "prefill": [_instance(by_name[f"p{i}"], f"P{i}", i) for i in range(ENGINES)],
            "decode": [
                _instance(by_name[f"d{i}"], f"D{i}", 100 + i, slots=64) for i in range(ENGINES)
            ],
            "kept_turns": {"enabled": True},
        }
        cfg = {
            "models": [model],
            "admission": {"replicas": REPLICAS},
            # Loads are read when the test says (before each request), not on a timer.
            "health": {"interval": 60, "load_interval": 3600},
            "retries": {"max_attempts": 1},
        }
        s = Scale(engines[:ENGINES], engines[ENGINES:], urls, stack)
        s.config = events_config(cfg, urls)
        for _ in range(REPLICAS):
            s.replicas.append(await s.start_replica())
        try:
            yield s
        finally:
            await asyncio.gather(*(own.aclose() for _, _, own in s.replicas))


def _instance(url: str, engine_id: str, n: int, **extra: Any) -> dict[str, Any]:
    return {
        "url": url,
        "engine_id": engine_id,
        "kv_host": f"10.0.{n // 256}.{n % 256}",
        "kv_port": 7000 + n,
        **extra,
    }


@dataclass
class Held:
    """One conversation's streamed turn, its tokens sent, held open before D's [DONE]."""

    response: httpx.Response
    stream: contextlib.AbstractAsyncContextManager[httpx.Response]
    chunks: AsyncIterator[bytes]
    gate: asyncio.Event


@dataclass
class Tally:
    turns: int = 0  # turns from each conversation's second on
    p_holds: int = 0
    d_holds: int = 0
    offered: int = 0
    spread: list[list[int]] = field(default_factory=list)  # streams per D after each round


async def test_four_replicas_route_by_what_eight_p_and_eight_d_report() -> None:
    async with scale() as s, httpx.AsyncClient(timeout=30) as client:
        gates: dict[str, asyncio.Event] = {}
        for d in s.decode:
            d.hold_done = lambda rec: gates.get(_conv_of(rec))
        held: dict[int, Held] = {}
        kept_on: dict[int, tuple[str, int]] = {}  # conv -> (D engine id, prompt blocks)
        tally = Tally()
        for turn in range(TURNS):
            if turn == RESTART_AFTER:
                await _replace_replica(s, 2, held)
            for conv in range(CONVERSATIONS):
                if conv in held:
                    await _release(held.pop(conv))
                    await _settled(s, len(held))
                url, ctx, _ = s.replicas[(conv + turn) % REPLICAS]
                await synced([ctx], s.engines)
                assert ctx.engine_loads is not None
                await ctx.engine_loads.read_all(ctx.registry.instances())
                gates[f"{conv:03d}"] = gate = asyncio.Event()
                held[conv] = await _open(client, url, conv, turn, gate)
                p_rec, d_rec = _legs(s, conv, turn)
                if turn:
                    _check(tally, conv, p_rec, d_rec, kept_on[conv])
                blocks = len(_prompt_ids(p_rec)) // BS
                kept_on[conv] = (_engine_id(s, d_rec), blocks)
            tally.spread.append(sorted(d.active for d in s.decode))
        for h in held.values():
            await _release(h)

    n = tally.turns
    report = (
        f"turns {n}: P holds {tally.p_holds}, D holds {tally.d_holds}, "
        f"kept turn offered {tally.offered}; streams per D by round {tally.spread}"
    )
    print(report)
    assert n == CONVERSATIONS * (TURNS - 1)
    assert tally.p_holds >= 0.95 * n and tally.d_holds >= 0.95 * n, report
    assert tally.offered >= 0.95 * n, report
    mean = CONVERSATIONS / ENGINES
    for spread in tally.spread:
        assert all(abs(k - mean) <= 0.1 * mean for k in spread), report


def _conv_of(rec: Received) -> str:
    messages = rec.body.get("messages") or []
    return str(messages[1]["content"]).split()[1] if len(messages) > 1 else ""


async def _open(
    client: httpx.AsyncClient, url: str, conv: int, turn: int, gate: asyncio.Event
) -> Held:
    body = {"model": "tiny", "messages": _messages(conv, turn), "max_tokens": 8, "stream": True}
    stream = client.stream(
        "POST",
        url + "/v1/chat/completions",
        json=body,
        headers={"x-session-id": f"conv-{conv:03d}"},
    )
    response = await stream.__aenter__()
    assert response.status_code == 200
    chunks = response.aiter_raw()
    await anext(chunks)  # D's first bytes: the stream is open and its slot held
    return Held(response, stream, chunks, gate)


async def _release(h: Held) -> None:
    h.gate.set()
    async for _ in h.chunks:
        pass
    await h.stream.__aexit__(None, None, None)


async def _settled(s: Scale, open_streams: int) -> None:
    """Released streams have left their D and every router's slot: D reports what is open,
    and the routers hold exactly that."""
    for _ in range(2000):
        on_engines = sum(d.active for d in s.decode)
        in_routers = sum(ctx.registry.slots_in_use() for _, ctx, _ in s.replicas)
        if on_engines == in_routers == open_streams:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("released streams did not settle")


def _legs(s: Scale, conv: int, turn: int) -> tuple[Received, Received]:
    tag = f"follow-up {turn - 1} of conversation {conv:03d}" if turn else f"{conv:03d} opens"
    recs = [
        r
        for e in s.engines
        for r in e.received
        if r.path.endswith("/chat/completions") and tag in str(r.body["messages"][-1])
    ]
    (p_rec,) = [r for r in recs if r.kv.get("do_remote_decode")]
    (d_rec,) = [r for r in recs if r.kv.get("do_remote_prefill")]
    return p_rec, d_rec


def _prompt_ids(rec: Received) -> list[int]:
    from tests.fakes.fake_vllm import _token_ids

    return _token_ids(rec.body)


def _engine_id(s: Scale, d_rec: Received) -> str:
    """The engine id of the D that served ``d_rec`` (from the config)."""
    for d in s.decode:
        if any(r is d_rec for r in d.received):
            return f"D{s.decode.index(d)}"
    raise AssertionError("no D served it")


def _check(t: Tally, conv: int, p: Received, d: Received, last: tuple[str, int]) -> None:
    last_d, last_blocks = last
    t.turns += 1
    t.p_holds += (p.cached or 0) >= last_blocks * BS
    t.d_holds += (d.cached or 0) >= last_blocks * BS
    reuse = p.kv.get("read_kept_turn") or {}
    t.offered += (
        reuse.get("transfer_id") == keep_id("tiny", "anonymous", f"conv-{conv:03d}")
        and reuse.get("remote_engine_id") == last_d
    )


async def _replace_replica(s: Scale, i: int, held: dict[int, Held]) -> None:
    """Stop replica ``i`` (its conversations' open turns end first) and start a fresh one."""
    own = s.replicas[i][2]
    for conv in [c for c in held if (c + RESTART_AFTER - 1) % REPLICAS == i]:
        await _release(held.pop(conv))
    await own.aclose()
    await _settled(s, len(held))
    s.replicas[i] = fresh = await s.start_replica()
    await synced([fresh[1]], s.engines)  # its replay has filled the index
    streams = fresh[1].kv_index.streams()
    assert len(streams) == 2 * ENGINES
    assert all(st.index.stats.replays >= 1 for st in streams)  # each asked for its history
    assert sum(st.index.stats.batches for st in streams) == sum(
        e.publisher.next_seq for e in s.engines if e.publisher is not None
    )
