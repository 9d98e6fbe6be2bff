"""Decode slot ledger: reservation, FIFO queueing, release on every path."""

from __future__ import annotations

import asyncio

import pytest

from router.errors import NoCapacity, QueueFull
from router.workers.breaker import Breaker
from router.workers.instance import Instance, Role
from router.workers.ledger import SlotLedger
from router.workers.policies import make_policy


def decode(url: str, slots: int) -> Instance:
    return Instance(url, Role.DECODE, "m", Breaker(3, 10), slots=slots)


def ledger(*insts: Instance, queue: int = 10, wait: float = 1.0) -> SlotLedger:
    return SlotLedger("m", insts, make_policy("least_loaded"), queue, wait)


async def test_reserve_and_release_count_slots() -> None:
    a, b = decode("a", 1), decode("b", 2)
    led = ledger(a, b)
    rs = [await led.reserve() for _ in range(3)]
    assert (a.in_flight, b.in_flight) == (1, 2) and led.slots_in_use == 3
    for r in rs:
        led.release(r)
        led.release(r)  # idempotent
    assert led.slots_in_use == 0


async def test_waiters_are_served_in_fifo_order() -> None:
    a = decode("a", 1)
    led = ledger(a)
    held = await led.reserve()
    order: list[int] = []

    async def wait(i: int) -> None:
        r = await led.reserve()
        order.append(i)
        led.release(r)

    tasks = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert led.queue_depth == 3
    led.release(held)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2] and led.slots_in_use == 0


async def test_queue_full_and_wait_timeout() -> None:
    led = ledger(decode("a", 1), queue=1, wait=0.05)
    held = await led.reserve()
    waiter = asyncio.create_task(led.reserve())
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await led.reserve()
    with pytest.raises(NoCapacity) as info:
        await waiter
    assert info.value.retry_after and led.queue_depth == 0
    led.release(held)
    assert led.slots_in_use == 0


async def test_cancelled_waiter_returns_a_slot_it_was_handed() -> None:
    a = decode("a", 1)
    led = ledger(a)
    held = await led.reserve()
    waiter = asyncio.create_task(led.reserve())
    await asyncio.sleep(0)
    led.release(held)  # hands the slot to the waiter's future...
    waiter.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert a.in_flight == 0 and led.queue_depth == 0


async def test_unroutable_instances_get_no_reservation_until_poked() -> None:
    a = decode("a", 1)
    a.healthy = False
    led = ledger(a)
    waiter = asyncio.create_task(led.reserve())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    a.healthy = True
    led.poke()
    r = await waiter
    assert r.instance is a
    led.release(r)


async def test_avoid_is_a_preference_not_a_ban() -> None:
    a, b = decode("a", 1), decode("b", 1)
    led = ledger(a, b)
    r1 = await led.reserve(avoid=frozenset({a}))
    assert r1.instance is b
    r2 = await led.reserve(avoid=frozenset({a}))
    assert r2.instance is a  # only a is free: better than failing
    led.release(r1)
    led.release(r2)


async def test_degraded_instance_is_out_of_rotation() -> None:
    a, b = decode("a", 4), decode("b", 4)
    a.degraded = True
    led = ledger(a, b)
    rs = [await led.reserve() for _ in range(4)]
    assert {r.instance for r in rs} == {b}
    for r in rs:
        led.release(r)
