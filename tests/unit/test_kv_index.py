"""One engine's block set from its events, and the cache-aware choice made from it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from router.config import parse_config
from router.engines.breaker import Breaker
from router.engines.instance import Instance, Role
from router.kvindex.blocks import pack, prefix_keys
from router.kvindex.engine import EngineIndex
from router.kvindex.index import KvIndex, sources
from router.kvindex.route import CacheRoute, Result
from router.kvindex.wire import Batch, Cleared, Removed, Stored
from router.registry import Registry
from tests.fakes.kv_events import PrefixCache
from tests.fakes.kv_events import Removed as FakeRemoved
from tests.fakes.kv_events import Stored as FakeStored

BS = 4
PROMPT = list(range(100, 130))  # 30 tokens: 7 full blocks of 4


def batch(*events: Stored | Removed | Cleared) -> Batch:
    return Batch(0.0, tuple(events), 0)


def from_fake(events: Sequence[object]) -> Batch:
    """A fake engine's events as the router decodes them."""
    out: list[Stored | Removed | Cleared] = []
    for e in events:
        if isinstance(e, FakeStored):
            out.append(
                Stored(tuple(e.hashes), e.parent, pack(e.token_ids), e.block_size, "GPU", True)
            )
        elif isinstance(e, FakeRemoved):
            out.append(Removed(tuple(e.hashes), "GPU", True))
    return batch(*out)


def indexed(tokens: Sequence[int], max_blocks: int = 1000) -> tuple[EngineIndex, PrefixCache]:
    cache = PrefixCache(BS)
    index = EngineIndex(max_blocks)
    index.known = True
    index.apply(from_fake(cache.store(tokens)))
    return index, cache


def test_an_engine_holds_the_full_blocks_it_stored_under_the_routers_own_keys() -> None:
    index, _ = indexed(PROMPT)
    keys = prefix_keys(PROMPT, BS)
    assert index.block_size == BS and index.blocks == 7
    assert index.matched(keys) == 7
    assert index.matched(prefix_keys([*PROMPT[:10], 0, *PROMPT[11:]], BS)) == 2  # edit in block 3
    assert index.matched(prefix_keys(PROMPT[1:], BS)) == 0  # same tokens, other positions


def test_a_continuation_chains_to_its_parent_and_a_removal_cuts_the_prefix() -> None:
    index, cache = indexed(PROMPT[:16])
    index.apply(from_fake(cache.store(PROMPT)))  # parent: block 4 of the first store
    keys = prefix_keys(PROMPT, BS)
    assert index.matched(keys) == 7
    third = cache.hashes(PROMPT)[2]
    index.apply(batch(Removed((third,), "GPU", True)))
    assert index.matched(keys) == 2 and index.blocks == 6


def test_a_block_stored_twice_stays_until_removed_twice() -> None:
    """Two requests computing one block in the same step: two stores, two removals."""
    index, cache = indexed(PROMPT[:8])
    h = cache.hashes(PROMPT[:8])
    index.apply(batch(Stored((h[0], h[1]), None, pack(PROMPT[:8]), BS, "GPU", True)))
    index.apply(batch(Removed((h[1],), "GPU", True)))
    assert index.matched(prefix_keys(PROMPT[:8], BS)) == 2
    index.apply(batch(Removed((h[1],), "GPU", True)))
    assert index.matched(prefix_keys(PROMPT[:8], BS)) == 1


def test_an_unknown_parent_and_blocks_not_keyed_by_tokens_alone_are_not_indexed() -> None:
    index = EngineIndex(100)
    index.apply(batch(Stored((7,), 999, pack(PROMPT[4:8]), BS, "GPU", True)))
    index.apply(batch(Stored((8,), None, pack(PROMPT[:4]), BS, "GPU", False)))
    assert index.blocks == 0 and index.stats.unkeyed == 2


def test_cleared_empties_the_set_and_makes_it_known() -> None:
    index, _ = indexed(PROMPT)
    index.known = False
    index.apply(batch(Cleared()))
    assert index.known and index.blocks == 0 and index.stats.cleared == 1


def test_the_bound_drops_the_least_recently_stored_blocks() -> None:
    index, cache = indexed(PROMPT, max_blocks=5)
    assert index.blocks == 5 and index.stats.evicted == 2
    assert index.matched(prefix_keys(PROMPT, BS)) == 0  # the prompt's first blocks went first
    other = [1, 2, 3, 4, 5, 6, 7, 8]
    index.apply(from_fake(cache.store(other)))
    assert index.matched(prefix_keys(other, BS)) == 2


# -- the route --------------------------------------------------------------------------


def inst(name: str, role: Role = Role.DECODE) -> Instance:
    return Instance(f"http://{name}", role, "m", Breaker(3, 1.0, lambda: 0.0))


def route(
    views: dict[str, EngineIndex | None],
    loads: dict[str, int] | None = None,
    tokens: Sequence[int] = PROMPT,
    cost: int = 1,
    factor: float = 1.25,
    tie: str = "conv",
) -> CacheRoute:
    load = loads or {}
    return CacheRoute(tokens, tie, views.get, lambda i: load.get(i.url, 0), factor, cost)


def known_empty() -> EngineIndex:
    index = EngineIndex(100)
    index.known = True
    return index


def test_the_engine_holding_the_prompt_is_chosen_and_its_hit_predicted_as_vllm_counts() -> None:
    a, b = inst("a"), inst("b")
    held, _ = indexed(PROMPT)
    r = route({a.url: known_empty(), b.url: held})
    assert r(Role.DECODE, [a, b]) is b
    # 30 tokens in blocks of 4: vLLM matches at most (30 - 1) // 4 = 7 blocks.
    assert r.predicted[Role.DECODE] == 28 and r.results[Role.DECODE] is Result.CACHED
    full = list(range(32))
    held_all, _ = indexed(full)
    r = route({a.url: held_all}, tokens=full)
    assert r(Role.DECODE, [a]) is a and r.predicted[Role.DECODE] == 28  # 31 // 4 = 7 blocks


def test_any_unknown_candidate_leaves_the_choice_to_the_usual_rule() -> None:
    a, b = inst("a"), inst("b")
    held, _ = indexed(PROMPT)
    unknown = EngineIndex(100)  # no events, no replay: not known
    for views in ({a.url: held, b.url: unknown}, {a.url: held}):
        r = route(views)
        assert r(Role.DECODE, [a, b]) is None and r.results[Role.DECODE] is Result.UNKNOWN


def test_load_costs_tokens_and_the_bound_keeps_a_hot_engine_from_taking_all() -> None:
    a, b = inst("a"), inst("b")
    held, _ = indexed(PROMPT)
    views: dict[str, EngineIndex | None] = {a.url: held, b.url: known_empty()}
    # a saves 28 of 30 tokens: worth 28 requests of load at 1 token each, under 1 at 32.
    assert route(views, {a.url: 3}, factor=10)(Role.DECODE, [a, b]) is a
    r = route(views, {a.url: 3}, cost=32, factor=10)
    assert r(Role.DECODE, [a, b]) is b and r.results[Role.DECODE] is Result.COLD
    # Within the bound only: ceil(1.25 * (3 + 1) / 2) = 3, and a carries 3.
    assert route(views, {a.url: 3}, cost=0)(Role.DECODE, [a, b]) is b
    assert route(views, {a.url: 2, b.url: 1}, cost=0)(Role.DECODE, [a, b]) is a


def test_ties_go_by_rendezvous_so_every_replica_picks_alike() -> None:
    engines = [inst(f"e{i}") for i in range(8)]
    views: dict[str, EngineIndex | None] = {e.url: known_empty() for e in engines}
    picks = {route(views, tie=f"conv{c}")(Role.DECODE, engines) for c in range(40)}
    assert len(picks) > 4  # spread by the tie key
    again = route(views, tie="conv7")(Role.DECODE, list(reversed(engines)))
    assert again is route(views, tie="conv7")(Role.DECODE, engines)


def test_the_holder_of_a_conversation_is_the_engine_with_the_most_of_it() -> None:
    a, b, c = inst("a"), inst("b"), inst("c")
    held, _ = indexed(PROMPT)
    part, _ = indexed(PROMPT[:12])
    r = route({a.url: part, b.url: held, c.url: None})
    assert r.holder([a, b, c], min_tokens=8) is b
    assert r.holder([a, b, c], min_tokens=29) is None


def test_sources_name_each_engines_endpoints() -> None:
    cfg = parse_config(
        {
            "models": [
                {
                    "name": "m",
                    "mode": "pull",
                    "kv_events": {"enabled": True, "port": 7000, "replay_port": None},
                    "prefill": [{"url": "http://10.0.0.1:8000"}],
                    "decode": [
                        {
                            "url": "http://[fd00::2]:8000",
                            "kv_events_replay": "tcp://[fd00::2]:7001",
                        },
                        {"url": "http://d3:8000", "kv_events_endpoint": "ipc:///run/d3"},
                    ],
                }
            ]
        }
    )
    got = {url: (s.endpoint, s.replay) for url, s in sources(cfg.models[0]).items()}
    assert got == {
        "http://10.0.0.1:8000": ("tcp://10.0.0.1:7000", None),
        "http://[fd00::2]:8000": ("tcp://[fd00::2]:7000", "tcp://[fd00::2]:7001"),
        "http://d3:8000": ("ipc:///run/d3", None),
    }
    off = cfg.models[0].model_copy(
        update={"kv_events": cfg.models[0].kv_events.model_copy(update={"enabled": False})}
    )
    assert sources(off) == {}


@pytest.mark.parametrize("bad", ["http://x:1", "tcp://host", "tcp://a b:1"])
def test_an_endpoint_that_is_not_zmq_is_refused_with_its_path(bad: str) -> None:
    from router.config import ConfigError

    with pytest.raises(ConfigError, match=r"models\.0\.decode\.0\.kv_events_endpoint: must be"):
        parse_config(
            {
                "models": [
                    {
                        "name": "m",
                        "mode": "aggregated",
                        "decode": [{"url": "http://d:1", "kv_events_endpoint": bad}],
                    }
                ]
            }
        )


async def test_the_index_follows_the_registry_as_one_listener_until_it_closes() -> None:
    """``KvIndex.follow`` subscribes beside other listeners (it overwrites none) and stops
    following when it closes: a later change starts no stream."""
    one = {"url": "http://127.0.0.1:9"}
    model = {
        "name": "m",
        "mode": "aggregated",
        "kv_events": {"enabled": True, "port": 7000, "replay_port": None},
        "decode": [one],
    }
    registry = Registry(parse_config({"models": [model]}))
    others: list[str] = []
    registry.subscribe(lambda: others.append("changed"))
    kv = KvIndex()
    kv.follow(registry)
    assert kv.view("http://127.0.0.1:9") is not None
    two = [one, {"url": "http://127.0.0.1:10"}]
    registry.apply(parse_config({"models": [{**model, "decode": two}]}))
    assert kv.view("http://127.0.0.1:10") is not None and others
    await kv.aclose()
    registry.apply(parse_config({"models": [model]}))
    assert kv.streams() == [] and len(others) >= 2
