"""Circuit breaker state machine and load-balancing policies."""

from __future__ import annotations

import random

from router.workers.breaker import Breaker, BreakerState
from router.workers.instance import Instance, Role
from router.workers.policies import make_policy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_half_opens_and_closes() -> None:
    clock = Clock()
    b = Breaker(threshold=2, open_seconds=10, clock=clock)
    b.record(False)
    assert b.state is BreakerState.CLOSED and b.allows()
    b.record(False)
    assert b.state is BreakerState.OPEN and not b.allows()
    clock.now = 10
    assert b.state is BreakerState.HALF_OPEN and b.allows()
    b.on_dispatch()
    assert not b.allows()  # one trial at a time
    b.record(False)
    assert b.state is BreakerState.OPEN
    clock.now = 20
    b.on_dispatch()
    b.record(True)
    assert b.state is BreakerState.CLOSED and b.allows()


def test_success_resets_the_failure_count() -> None:
    b = Breaker(threshold=2, open_seconds=1)
    b.record(False)
    b.record(True)
    b.record(False)
    assert b.state is BreakerState.CLOSED


def insts(n: int) -> list[Instance]:
    return [Instance(f"u{i}", Role.DECODE, "m", Breaker(1, 1), slots=4) for i in range(n)]


def test_round_robin_cycles() -> None:
    pol, xs = make_policy("round_robin"), insts(3)
    assert [pol.select(xs, None).url for _ in range(6)] == ["u0", "u1", "u2"] * 2


def test_least_loaded_prefers_free_capacity_and_spreads_ties() -> None:
    pol, xs = make_policy("least_loaded"), insts(3)
    xs[0].in_flight, xs[1].in_flight, xs[2].in_flight = 3, 1, 1
    picks = {pol.select(xs, None).url for _ in range(4)}
    assert picks == {"u1", "u2"}


def test_power_of_two_never_picks_the_most_loaded_of_two() -> None:
    pol, xs = make_policy("power_of_two"), insts(2)
    xs[0].in_flight = 4
    assert all(pol.select(xs, None).url == "u1" for _ in range(20))


def test_prefix_hash_is_sticky_and_moves_little() -> None:
    pol, xs = make_policy("prefix_hash"), insts(4)
    keys = [f"prompt {random.random()}" for _ in range(200)]
    before = {k: pol.select(xs, k).url for k in keys}
    assert all(pol.select(xs, k).url == before[k] for k in keys)
    after = {k: pol.select(xs[:3], k).url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "u3" for k in moved)  # only the removed engine's keys move
