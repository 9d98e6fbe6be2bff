"""D's token events spliced to the client (router/http1.py's ``splice``: written as they
arrive, in the engine connection's callback, while the client reads), on real sockets.

The fake D streams a few tokens and stalls on an event the test holds; once the router's
reader has armed its splice and waits, the test lets the rest come: each token event then
arrives while nothing is buffered, so the splice is offered it, deterministically. What the
client gets must be byte for byte what the same request gets with the splice off (every
chunk read by the relay's loop), request ids and timestamps aside.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from router.http1 import Http1Response, Sink
from tests.conftest import Cluster, eventually
from tests.integration.test_migration import check_one_answer, content, events, reference

N = 12  # tokens asked for
K = 3  # tokens before the stall
COMPLETION = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": N, "stream": True}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "tell me a story"}],
    "max_tokens": N,
    "stream": True,
}
PATHS = {"completions": ("/v1/completions", COMPLETION), "chat": ("/v1/chat/completions", CHAT)}
# What differs between two requests' answers: the ids and creation times the engines set.
_PER_REQUEST = re.compile(rb'"(id|created)":\s*("[^"]*"|\d+)')


@dataclass
class Splices:
    """What the streams' splices did: sinks armed, chunks taken and refused. ``off``: no
    stream splices (every chunk read by the relay's loop: the reference)."""

    off: bool = False
    armed: int = 0
    taken: int = 0
    refused: int = 0


@pytest.fixture
def splices(monkeypatch: pytest.MonkeyPatch) -> Iterator[Splices]:
    seen = Splices()
    splice = Http1Response.splice

    def counted(response: Http1Response, sink: Sink | None) -> bool:
        if sink is None:
            return splice(response, None)
        if seen.off:
            return False
        seen.armed += 1

        def take(chunk: bytes) -> bool:
            taken = sink(chunk)
            seen.taken += taken
            seen.refused += not taken
            return taken

        return splice(response, take)

    monkeypatch.setattr(Http1Response, "splice", counted)
    yield seen


def _held(cluster: Cluster, gate: asyncio.Event) -> None:
    for d in cluster.decode:
        d.behaviour.deterministic = True
        d.behaviour.stall_after, d.behaviour.stall_gate = K, gate


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("migration", [0, 2])
@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_token_events_are_spliced_and_the_client_gets_the_same_bytes(
    cluster: Cluster,
    client: httpx.AsyncClient,
    splices: Splices,
    mode: str,
    migration: int,
    endpoint: str,
) -> None:
    """With migration off (DecodeLeg.forward) and on (LegReading.take, ids made null), the
    events after the stall are written by the splice, and the answer is the one the relay's
    loop gives reading every chunk."""
    if mode == "push":
        cluster.prefill[0].behaviour.transfer_mode = "push"
    path, body = PATHS[endpoint]
    url, ctx = await cluster.router(mode, migration={"max_attempts": migration})
    d = cluster.decode[0]

    async def answer(off: bool) -> bytes:
        splices.off = off
        gate = asyncio.Event()
        _held(cluster, gate)
        d.stalled.clear()
        armed = splices.armed
        task = asyncio.create_task(client.post(url + path, json=body))
        try:
            await eventually(lambda: d.stalled.is_set() and (off or splices.armed > armed))
        finally:
            gate.set()
        r = await asyncio.wait_for(task, 30)
        assert r.status_code == 200
        return r.content

    read = await answer(off=True)
    assert splices.taken == 0
    spliced = await answer(off=False)
    docs = events(spliced.decode())
    assert "".join(map(content, docs)) == reference(body)
    check_one_answer(docs, endpoint == "chat")
    assert _PER_REQUEST.sub(b"", spliced) == _PER_REQUEST.sub(b"", read)
    # The tokens after the stall came while the reader waited: the splice wrote them (all
    # but, with migration, the final chunk, which the reader reads to record its end).
    assert splices.taken >= N - K - 1
    await eventually(lambda: ctx.registry.slots_in_use() == 0)
