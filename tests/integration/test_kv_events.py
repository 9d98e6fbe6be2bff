"""The router's KV index fed by real ZMQ sockets: a fake engine publishes in vLLM 0.32's wire
format (tests/fakes/kv_events.py); the router subscribes, replays after a late start, a gap or
a restart, and says when what it holds is the engine's whole cache (known) and when not."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from router.kvindex.blocks import prefix_keys
from router.kvindex.engine import EngineIndex
from router.kvindex.index import KvIndex
from router.kvindex.stream import Source, Stream
from tests.conftest import eventually
from tests.fakes.kv_events import Encoding, PrefixCache, Publisher

URL = "http://engine"
BS = 16
PROMPTS = [list(range(k * 1000, k * 1000 + 64)) for k in range(6)]  # 4 blocks each


@contextlib.asynccontextmanager
async def engine(
    encoding: Encoding = "map", buffer_steps: int = 10_000
) -> AsyncIterator[tuple[Publisher, PrefixCache]]:
    pub = Publisher(encoding, buffer_steps)
    await pub.start()
    try:
        yield pub, PrefixCache(BS)
    finally:
        await pub.aclose()


@contextlib.asynccontextmanager
async def follow(
    pub: Publisher, replay: bool = True, verify: float = 10.0
) -> AsyncIterator[tuple[KvIndex, EngineIndex]]:
    kv = KvIndex()
    source = Source(
        pub.endpoint,
        pub.replay_endpoint if replay else None,
        verify_interval=verify,
        replay_timeout=0.5,
    )
    kv.sync({URL: source})
    index = kv.view(URL)
    assert index is not None
    try:
        yield kv, index
    finally:
        await kv.aclose()


def publish(pub: Publisher, cache: PrefixCache, tokens: list[int]) -> None:
    pub.publish(cache.store(tokens))


async def caught_up(kv: KvIndex, pub: Publisher) -> None:
    (stream,) = kv.streams()
    await eventually(lambda: stream.next_seq == pub.next_seq)


def held(index: EngineIndex, tokens: list[int]) -> int:
    return index.matched(prefix_keys(tokens, BS))


async def test_an_engine_that_published_nothing_is_known_and_empty() -> None:
    async with engine() as (pub, _), follow(pub) as (_, index):
        await eventually(lambda: index.known)
        assert index.blocks == 0 and pub.replays == 1


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_events_build_the_engines_block_set_in_either_encoding(encoding: Encoding) -> None:
    async with engine(encoding) as (pub, cache), follow(pub) as (kv, index):
        await eventually(lambda: index.known)
        publish(pub, cache, PROMPTS[0])
        publish(pub, cache, [*PROMPTS[0], *PROMPTS[1]])  # a continuation: parent in batch 0
        await caught_up(kv, pub)
        assert held(index, [*PROMPTS[0], *PROMPTS[1]]) == 8 and held(index, PROMPTS[1]) == 0
        assert index.stats.stored == 8 and index.stats.decode_errors == 0


async def test_a_late_subscriber_replays_the_whole_history() -> None:
    async with engine() as (pub, cache):
        for p in PROMPTS[:3]:
            publish(pub, cache, p)
        async with follow(pub) as (kv, index):
            await caught_up(kv, pub)
            assert index.known and all(held(index, p) == 4 for p in PROMPTS[:3])


async def test_a_gap_is_filled_from_the_replay_endpoint() -> None:
    async with engine() as (pub, cache), follow(pub) as (kv, index):
        await eventually(lambda: index.known)
        publish(pub, cache, PROMPTS[0])
        await caught_up(kv, pub)
        pub.lose = 2  # these two never reach the SUB socket
        for p in PROMPTS[1:4]:
            publish(pub, cache, p)
        await caught_up(kv, pub)
        assert index.known and all(held(index, p) == 4 for p in PROMPTS[:4])
        assert (index.stats.gaps, index.stats.gaps_filled, index.stats.gaps_unfilled) == (1, 1, 0)


async def test_a_gap_no_replay_can_fill_leaves_the_engine_unknown_until_its_cache_clears() -> None:
    async with engine() as (pub, cache), follow(pub) as (kv, index):
        await eventually(lambda: index.known)
        publish(pub, cache, PROMPTS[0])
        await caught_up(kv, pub)
        pub.replay_enabled = False  # the replay endpoint stops answering
        pub.lose = 1
        publish(pub, cache, PROMPTS[1])
        publish(pub, cache, PROMPTS[2])
        await caught_up(kv, pub)
        # Unknown, not empty: what it holds is not read as all it holds.
        assert not index.known and index.stats.gaps_unfilled == 1
        assert held(index, PROMPTS[2]) == 4  # later events still applied
        pub.publish(cache.clear())
        await caught_up(kv, pub)
        assert index.known and index.blocks == 0


async def test_an_unknown_engine_is_known_again_once_its_replay_answers() -> None:
    async with engine() as (pub, cache), follow(pub, verify=0.1) as (kv, index):
        await eventually(lambda: index.known)
        pub.replay_enabled = False
        pub.lose = 1
        publish(pub, cache, PROMPTS[0])
        publish(pub, cache, PROMPTS[1])
        await caught_up(kv, pub)
        assert not index.known
        pub.replay_enabled = True  # its buffer still starts at 0: the whole history
        await eventually(lambda: index.known)
        assert held(index, PROMPTS[0]) == 4 and held(index, PROMPTS[1]) == 4


async def test_a_history_longer_than_the_replay_buffer_stays_unknown() -> None:
    async with engine(buffer_steps=2) as (pub, cache):
        for p in PROMPTS[:4]:
            publish(pub, cache, p)
        async with follow(pub) as (kv, index):
            await caught_up(kv, pub)
            assert not index.known and held(index, PROMPTS[3]) == 4


async def test_a_restart_seen_in_the_stream_rebuilds_the_index_from_zero() -> None:
    async with engine() as (pub, cache), follow(pub) as (kv, index):
        for p in PROMPTS[:3]:
            publish(pub, cache, p)
        await caught_up(kv, pub)
        pub.restart()
        cache = PrefixCache(BS)  # the new engine's cache is empty
        publish(pub, cache, PROMPTS[4])
        await caught_up(kv, pub)
        assert index.known and index.stats.restarts == 1
        assert held(index, PROMPTS[0]) == 0 and held(index, PROMPTS[4]) == 4


async def test_a_restart_whose_messages_were_all_missed_is_found_by_verification() -> None:
    async with engine() as (pub, cache), follow(pub, verify=0.1) as (kv, index):
        publish(pub, cache, PROMPTS[0])
        await caught_up(kv, pub)
        pub.restart()  # and nothing published since
        await eventually(lambda: index.stats.restarts == 1)
        await eventually(lambda: index.known and index.blocks == 0)


async def test_without_a_replay_endpoint_an_engine_is_known_only_from_its_first_batch() -> None:
    async with engine() as (pub, cache):
        async with follow(pub, replay=False) as (kv, index):
            assert not index.known  # no events yet: unknown, not empty
            await pub.subscribed(1)
            publish(pub, cache, PROMPTS[0])
            await caught_up(kv, pub)
            assert index.known and held(index, PROMPTS[0]) == 4
        publish(pub, cache, PROMPTS[1])  # nobody listens
        async with follow(pub, replay=False) as (kv, index):  # joins late: seq 2 comes first
            await pub.subscribed(2)
            publish(pub, cache, PROMPTS[2])
            await caught_up(kv, pub)
            assert not index.known and held(index, PROMPTS[2]) == 4


async def test_a_stream_that_fails_leaves_its_engine_unknown_not_stale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with engine() as (pub, cache), follow(pub) as (kv, index):
        publish(pub, cache, PROMPTS[0])
        await caught_up(kv, pub)
        assert index.known

        async def broken(self: object, frames: list[bytes]) -> None:
            raise RuntimeError("a bug while applying a batch")

        monkeypatch.setattr(Stream, "_on_message", broken)
        publish(pub, cache, PROMPTS[1])
        await eventually(lambda: not index.known)
