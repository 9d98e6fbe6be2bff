"""The placement rule of router/engines/affinity.py: sticky, consistent, bounded."""

from __future__ import annotations

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


def test_a_session_goes_where_there_is_room_else_to_the_least_loaded() -> None:
    rng = random.Random(7)
    aff = Affinity(SessionConfig(spill_at=0.5), Clock())
    ds = _decodes(3, slots=20)  # room while slots held + 1 <= 10
    for _ in range(2000):
        for d in ds:
            hold_slots(d, rng.randint(0, 20))
        chosen, _ = aff.select(Role.DECODE, rng.choice("abc"), ds)
        if any(d.slots_held + 1 <= 10 for d in ds):
            assert chosen.slots_held + 1 <= 10
        else:
            assert chosen.slots_held == min(d.slots_held for d in ds)


def test_a_session_stays_until_its_engine_nears_its_slots() -> None:
    """Far above the other engines' load, but below spill_at of its own slots: it stays."""
    aff = Affinity(SessionConfig(spill_at=0.9), Clock())
    ds = _decodes(2)  # 100 slots each: room while slots held + 1 <= 90
    home, how = aff.select(Role.DECODE, "s", ds)
    assert how is Placement.PLACED
    hold_slots(home, 89)
    assert aff.select(Role.DECODE, "s", ds) == (home, Placement.HIT)
    hold_slots(home, 90)
    other, how = aff.select(Role.DECODE, "s", ds)
    assert other is not home and how is Placement.SPILLED


def test_a_prefill_session_spills_at_prefill_capacity() -> None:
    ps = [
        Instance(f"http://p{i}:8000", Role.PREFILL, "m", Breaker(3, 10.0, lambda: 0.0))
        for i in range(2)
    ]
    load = dict.fromkeys(ps, 0)
    cfg = SessionConfig(spill_at=0.5, prefill_capacity=8)
    aff = Affinity(cfg, Clock(), load=load.__getitem__)  # P's load, as the engines report it
    home, _ = aff.select(Role.PREFILL, "s", ps)
    load[home] = 3  # 3 + 1 <= floor(0.5 x 8)
    assert aff.select(Role.PREFILL, "s", ps) == (home, Placement.HIT)
    load[home] = 4
    assert aff.select(Role.PREFILL, "s", ps)[1] is Placement.SPILLED


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
