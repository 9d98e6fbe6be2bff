"""Shared decode slot table of ``--workers N``: exact bound across real processes,
reset of a dead worker's row, and ledgers of two workers sharing one table."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from typing import Any

import pytest

from router.engines.breaker import Breaker
from router.engines.instance import Instance, Role
from router.engines.ledger import SlotLedger
from router.engines.policies import make_policy
from router.shared_slots import SharedSlotTable, SlotTableFull, slot_key

MP = multiprocessing.get_context("fork")
KEY = slot_key("m", "http://d")
LIMIT = 3


def _hammer(table: SharedSlotTable, worker: int, rounds: int, holding: Any, peak: Any) -> None:
    """Acquire/release in a loop; count holders router-wide outside the table."""
    view = table.bind(worker)
    for _ in range(rounds):
        if not view.try_acquire(KEY, LIMIT):
            continue
        with holding.get_lock():
            holding.value += 1
            peak.value = max(peak.value, holding.value)
        with holding.get_lock():
            holding.value -= 1
        view.release(KEY)


def test_two_processes_never_exceed_the_limit() -> None:
    table = SharedSlotTable(2, ctx=MP)
    holding, peak = MP.Value("i", 0), MP.Value("i", 0)
    procs = [MP.Process(target=_hammer, args=(table, w, 20_000, holding, peak)) for w in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert 1 <= peak.value <= LIMIT
    view = table.bind(0)
    assert view.total(KEY) == 0 and view.mine(KEY) == 0


def _hold_and_die(table: SharedSlotTable, worker: int, n: int, hold_lock: bool) -> None:
    view = table.bind(worker)
    for _ in range(n):
        assert view.try_acquire(KEY, 10)
    if hold_lock:
        table._enter(worker)  # killed inside a critical section
    os._exit(1)


@pytest.mark.parametrize("hold_lock", [False, True])
def test_reset_worker_frees_a_dead_workers_slots(hold_lock: bool) -> None:
    table = SharedSlotTable(2, ctx=MP)
    live = table.bind(0)
    assert live.try_acquire(KEY, 10)
    p = MP.Process(target=_hold_and_die, args=(table, 1, 3, hold_lock))
    p.start()
    p.join(30)
    assert live.total(KEY) == 4
    table.reset_worker(1)
    assert live.total(KEY) == 1 and live.mine(KEY) == 1
    assert live.try_acquire(KEY, 2) and not live.try_acquire(KEY, 2)


def test_release_never_takes_another_workers_slot() -> None:
    table = SharedSlotTable(2)
    a, b = table.bind(0), table.bind(1)
    assert a.try_acquire(KEY, 5)
    b.release(KEY)
    assert a.total(KEY) == 1


def test_full_table_is_a_clear_error() -> None:
    view = SharedSlotTable(1, capacity=2).bind(0)
    view.total("a")
    view.total("b")
    with pytest.raises(SlotTableFull, match="full"):
        view.total("c")


def _ledger(table: SharedSlotTable, worker: int, slots: int) -> tuple[SlotLedger, Instance]:
    inst = Instance("http://d", Role.DECODE, "m", Breaker(3, 10), slots=slots)
    led = SlotLedger("m", [inst], make_policy("least_loaded"), 10, 2.0, table.bind(worker))
    return led, inst


async def test_two_ledgers_share_slots_and_wake_each_other() -> None:
    table = SharedSlotTable(2)
    led0, inst0 = _ledger(table, 0, 2)
    led1, inst1 = _ledger(table, 1, 2)
    held = [await led0.reserve(), await led1.reserve()]
    assert inst0.free_slots == inst1.free_slots == 0
    assert (inst0.slots_held, inst0.in_use) == (1, 2)
    waiter = asyncio.create_task(led1.reserve())
    await asyncio.sleep(0.02)
    assert not waiter.done() and led1.queue_depth == 1
    led0.release(held[0])  # a release in the other worker wakes this one's waiter
    got = await asyncio.wait_for(waiter, 1.0)
    assert got.instance is inst1 and inst1.in_use == 2
    for r in (held[1], got):
        led1.release(r)
    assert inst0.in_use == 0 and led1.queue_depth == 0
