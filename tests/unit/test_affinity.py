"""The placement rule of router/engines/affinity.py: sticky, consistent, bounded."""

from __future__ import annotations

import math
import random

from router.config import SessionConfig
from router.engines.affinity import Affinity, Placement
from router.engines.breaker import Breaker
from router.engines.instance import Instance, Role
from tests.fakes.clock import Clock
from tests.fakes.instances import hold_slots


def _decodes(n: int, slots: int = 100) -> list[Instance]:
    out = []
    for i in range(n):
        inst = Instance(f"http://d{i}:8000", Role.DECODE, "m", Breaker(3, 10.0, lambda: 0.0))
        inst.set_slots(slots)
        out.append(inst)
    return out


def test_a_session_sticks_and_new_ones_spread() -> None:
    aff = Affinity(SessionConfig(), Clock())
    ds = _decodes(4)
    first = {k: aff.select(Role.DECODE, k, ds)[0] for k in map(str, range(200))}
    assert all(aff.select(Role.DECODE, k, ds) == (first[k], Placement.HIT) for k in first)
    counts = [sum(1 for v in first.values() if v is d) for d in ds]
    assert min(counts) > 20, counts  # 200 keys over 4 engines by hash, none starved


def test_removing_an_instance_moves_only_its_sessions() -> None:
    ds = _decodes(4)
    before = Affinity(SessionConfig(), Clock())
    placed = {k: before.select(Role.DECODE, k, ds)[0] for k in map(str, range(200))}
    fresh = Affinity(SessionConfig(), Clock())  # another replica: no shared table
    rest = ds[1:]
    for k, inst in placed.items():
        again, _ = fresh.select(Role.DECODE, k, rest)
        if inst is not ds[0]:
            assert again is inst, k


def test_no_instance_exceeds_the_bound() -> None:
    rng = random.Random(7)
    cfg = SessionConfig(load_factor=1.25)
    aff = Affinity(cfg, Clock())
    ds = _decodes(3)
    for _ in range(2000):
        for d in ds:
            hold_slots(d, rng.randint(0, 20))
        total = sum(d.slots_held for d in ds)
        cap = math.ceil(1.25 * (total + 1) / 3)
        chosen, _ = aff.select(Role.DECODE, rng.choice("abc"), ds)
        assert chosen.slots_held + 1 <= cap


def test_an_overloaded_sticky_instance_spills() -> None:
    aff = Affinity(SessionConfig(load_factor=1.0), Clock())
    ds = _decodes(2)
    home, how = aff.select(Role.DECODE, "s", ds)
    assert how is Placement.PLACED
    hold_slots(home, 10)
    other, how = aff.select(Role.DECODE, "s", ds)
    assert other is not home and how is Placement.SPILLED


def test_table_is_lru_bounded_and_entries_expire() -> None:
    clock = Clock()
    aff = Affinity(SessionConfig(max_sessions=3, ttl_seconds=10), clock)
    ds = _decodes(2)
    for k in "abcd":
        aff.select(Role.DECODE, k, ds)
    assert len(aff) == 3  # "a", the least recently used, was dropped
    clock.now = 5
    aff.select(Role.DECODE, "b", ds)
    clock.now = 12  # "c" and "d" unused for over 10 s; "b" used at 5
    aff.select(Role.PREFILL, "e", ds)
    assert len(aff) == 2
