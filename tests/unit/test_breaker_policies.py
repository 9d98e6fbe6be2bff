"""Circuit breaker state machine and load-balancing policies."""

from __future__ import annotations

import random

from router.engines.breaker import Breaker, BreakerState
from router.engines.instance import Instance, Role
from router.engines.policies import make_policy
from router.errors import Fault
from tests.fakes.clock import Clock
from tests.fakes.instances import hold_slots


def test_engine_faults_eject_half_open_and_close() -> None:
    clock = Clock()
    b = Breaker(threshold=2, open_seconds=10, clock=clock)
    b.record(Fault.ENGINE)
    assert b.state is BreakerState.CLOSED and b.allows()
    b.record(Fault.ENGINE)
    assert b.state is BreakerState.OPEN and not b.allows()
    clock.now = 10
    assert b.state is BreakerState.HALF_OPEN and b.allows()
    b.on_dispatch()
    assert not b.allows()  # one trial at a time
    b.record(Fault.ENGINE)
    assert b.state is BreakerState.OPEN and b.reopens_at == 20
    clock.now = 20
    b.on_dispatch()
    b.record(None)
    assert b.state is BreakerState.CLOSED and b.allows()


def test_success_resets_the_fault_streaks() -> None:
    b = Breaker(threshold=2, open_seconds=1, answer_threshold=2)
    b.record(Fault.ENGINE)
    b.record(None)
    b.record(Fault.ENGINE)
    b.record(Fault.ANSWER)
    b.record(None)
    b.record(Fault.ANSWER)
    assert b.state is BreakerState.CLOSED


def test_a_refused_connection_ejects_at_once() -> None:
    b = Breaker(threshold=5, open_seconds=10)
    b.record(Fault.REFUSED)
    assert b.state is BreakerState.OPEN


def test_error_answers_eject_only_while_another_instance_remains() -> None:
    """The panic threshold: bad prompts never eject the last instance of a role."""
    last = Breaker(threshold=5, open_seconds=10, answer_threshold=3)
    for _ in range(10):
        last.record(Fault.ANSWER, may_eject=False)
    assert last.state is BreakerState.CLOSED
    spare = Breaker(threshold=5, open_seconds=10, answer_threshold=3)
    for _ in range(2):
        spare.record(Fault.ANSWER, may_eject=True)
    assert spare.state is BreakerState.CLOSED
    spare.record(Fault.ANSWER, may_eject=True)
    assert spare.state is BreakerState.OPEN


def test_no_verdict_counts_nothing_but_frees_the_half_open_trial() -> None:
    clock = Clock()
    b = Breaker(threshold=1, open_seconds=10, clock=clock)
    for _ in range(5):
        b.record(Fault.BLAMELESS)
    assert b.state is BreakerState.CLOSED
    b.record(Fault.ENGINE)
    clock.now = 10
    b.on_dispatch()
    assert not b.allows()
    b.record(Fault.BLAMELESS)  # the trial's client left: the next request is the trial
    assert b.state is BreakerState.HALF_OPEN and b.allows()


def test_a_probe_ends_an_ejection_once_the_engine_was_seen_down() -> None:
    clock = Clock()
    refused = Breaker(threshold=5, open_seconds=10, clock=clock)
    refused.record(Fault.REFUSED)
    refused.probe(True)  # it listens again (restarted): back before the 10 s
    assert refused.state is BreakerState.HALF_OPEN
    slow = Breaker(threshold=1, open_seconds=10, clock=clock)
    slow.record(Fault.ENGINE)
    slow.probe(True)  # /health answers, yet requests time out: stays out
    assert slow.state is BreakerState.OPEN
    slow.probe(False)
    slow.probe(True)  # down, then back: a restart
    assert slow.state is BreakerState.HALF_OPEN


def test_every_transition_calls_the_owner() -> None:
    clock = Clock()
    b = Breaker(threshold=1, open_seconds=10, clock=clock)
    changes: list[BreakerState] = []
    b.on_change = lambda: changes.append(b._state)
    b.record(Fault.ENGINE)
    clock.now = 10
    b.allows()
    b.record(None)
    assert changes == [BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.CLOSED]


def insts(n: int) -> list[Instance]:
    return [Instance(f"u{i}", Role.DECODE, "m", Breaker(1, 1), slots=4) for i in range(n)]


def test_round_robin_cycles() -> None:
    pol, xs = make_policy("round_robin"), insts(3)
    assert [pol.select(xs, None).url for _ in range(6)] == ["u0", "u1", "u2"] * 2


def test_least_loaded_prefers_free_capacity_and_spreads_ties() -> None:
    pol, xs = make_policy("least_loaded"), insts(3)
    for inst, held in zip(xs, (3, 1, 1), strict=True):
        hold_slots(inst, held)
    picks = {pol.select(xs, None).url for _ in range(4)}
    assert picks == {"u1", "u2"}


def test_power_of_two_never_picks_the_most_loaded_of_two() -> None:
    pol, xs = make_policy("power_of_two"), insts(2)
    hold_slots(xs[0], 4)
    assert all(pol.select(xs, None).url == "u1" for _ in range(20))


def test_prefix_hash_is_sticky_and_moves_little() -> None:
    pol, xs = make_policy("prefix_hash"), insts(4)
    keys = [f"prompt {random.random()}" for _ in range(200)]
    before = {k: pol.select(xs, k).url for k in keys}
    assert all(pol.select(xs, k).url == before[k] for k in keys)
    after = {k: pol.select(xs[:3], k).url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "u3" for k in moved)  # only the removed engine's keys move
