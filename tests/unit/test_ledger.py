"""Decode slot ledger: reservation, FIFO queueing, release on every path, and the
re-evaluation of waiters whenever routability changes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from router.engines.breaker import Breaker
from router.engines.instance import Instance, Role
from router.engines.ledger import SlotLedger
from router.engines.policies import make_policy
from router.engines.selection import Selection
from router.errors import Fault, NoCapacity, NoHealthyEngine, QueueFull
from tests.conftest import eventually
from tests.fakes.clock import Clock


def decode(
    url: str,
    slots: int,
    clock: Callable[[], float] = time.monotonic,
    open_seconds: float = 10.0,
) -> Instance:
    return Instance(url, Role.DECODE, "m", Breaker(3, open_seconds, clock), slots=slots)


def ledger(
    *insts: Instance,
    queue: int = 10,
    wait: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
) -> SlotLedger:
    return SlotLedger(
        "m", insts, make_policy("least_loaded"), queue, wait, probe_interval=5.0, clock=clock
    )


async def test_reserve_and_release_count_slots() -> None:
    a, b = decode("a", 1), decode("b", 2)
    led = ledger(a, b)
    rs = [await led.reserve() for _ in range(3)]
    assert (a.slots_held, b.slots_held) == (1, 2) and led.slots_in_use == 3
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
    await eventually(lambda: led.queue_depth == 3)
    led.release(held)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2] and led.slots_in_use == 0


async def test_queue_full_and_wait_timeout() -> None:
    led = ledger(decode("a", 1), queue=1, wait=30.0)
    held = await led.reserve()
    waiter = asyncio.create_task(led.reserve())
    await eventually(lambda: led.queue_depth == 1)
    with pytest.raises(QueueFull):
        await led.reserve()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert led.queue_depth == 0
    led.set_limits(queue_size=1, max_wait=0.05, probe_interval=5.0)
    with pytest.raises(NoCapacity) as info:
        await asyncio.wait_for(led.reserve(), 10.0)
    assert info.value.retry_after and led.queue_depth == 0
    led.release(held)
    assert led.slots_in_use == 0


async def test_cancelled_waiter_returns_a_slot_it_was_handed() -> None:
    a = decode("a", 1)
    led = ledger(a)
    held = await led.reserve()
    waiter = asyncio.create_task(led.reserve())
    await eventually(lambda: led.queue_depth == 1)
    led.release(held)  # hands the slot to the waiter's future...
    assert a.slots_held == 1 and led.queue_depth == 0  # ...at once, as the release runs
    waiter.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert a.slots_held == 0 and led.queue_depth == 0


async def test_no_decode_in_rotation_is_refused_at_once_with_the_earliest_return() -> None:
    clock = Clock()
    a, b = decode("a", 1, clock), decode("b", 1, clock)
    a.breaker.record(Fault.REFUSED)  # ejected until 10
    b.healthy = False  # back at the next probe (5 s) at the earliest
    led = ledger(a, b, clock=clock)
    clock.now = 7.5
    with pytest.raises(NoHealthyEngine) as info:
        await led.reserve()
    assert info.value.status == 503 and info.value.code == "no_healthy_decode"
    assert info.value.headers() == {"retry-after": "3"}  # a's ejection ends in 2.5 s
    assert led.queue_depth == 0


async def test_a_waiter_is_served_when_an_ejection_ends_by_itself() -> None:
    """Nothing but time changes: the ledger's own timer re-evaluates its waiters
    (the outage of issue 11: waiters that nothing woke, new requests behind them)."""
    a, b = decode("a", 1), decode("b", 1, open_seconds=0.05)
    b.breaker.record(Fault.REFUSED)
    led = ledger(a, b, wait=5.0)
    held = await led.reserve()
    assert held.instance is a
    waiter = asyncio.create_task(led.reserve())
    got = await asyncio.wait_for(waiter, 10.0)
    assert got.instance is b
    later = asyncio.create_task(led.reserve())  # b half-open, its trial out: waits
    await eventually(lambda: led.queue_depth == 1)
    assert not later.done()
    b.breaker.record(None)  # the trial succeeded: b closes, but it is full
    led.release(held)  # a's slot goes to the waiter at once
    assert (await asyncio.wait_for(later, 10.0)).instance is a


async def test_health_and_leak_verdicts_reach_waiters_without_a_call() -> None:
    a, b = decode("a", 1), decode("b", 1)
    b.healthy = False
    led = ledger(a, b, wait=5.0)
    held = await led.reserve()
    waiter = asyncio.create_task(led.reserve())
    await eventually(lambda: led.queue_depth == 1)
    assert not waiter.done()
    b.healthy = True  # nothing else: the instance tells the ledger
    assert (await asyncio.wait_for(waiter, 10.0)).instance is b
    led.release(held)


async def test_waiters_are_refused_when_the_last_decode_leaves_rotation() -> None:
    a = decode("a", 1)
    led = ledger(a, wait=30.0)
    held = await led.reserve()
    waiters = [asyncio.create_task(led.reserve()) for _ in range(3)]
    await eventually(lambda: led.queue_depth == 3)
    a.healthy = False
    for w in waiters:
        with pytest.raises(NoHealthyEngine):
            await asyncio.wait_for(w, 10.0)
    assert led.queue_depth == 0
    led.release(held)
    assert a.slots_held == 0


async def test_a_half_open_decode_takes_more_than_its_trial_when_it_is_the_last() -> None:
    clock = Clock()
    a = decode("a", 4, clock)
    a.breaker.record(Fault.REFUSED)
    clock.now = 10  # half-open
    led = ledger(a, clock=clock)
    rs = [await asyncio.wait_for(led.reserve(), 10.0) for _ in range(3)]
    assert {r.instance for r in rs} == {a}
    for r in rs:
        led.release(r)


async def test_avoid_is_a_preference_not_a_ban() -> None:
    a, b = decode("a", 1), decode("b", 1)
    led = ledger(a, b)
    r1 = await led.reserve(Selection(avoid=frozenset({a})))
    assert r1.instance is b
    r2 = await led.reserve(Selection(avoid=frozenset({a})))
    assert r2.instance is a  # only a is free: better than failing
    led.release(r1)
    led.release(r2)


async def test_degraded_instance_is_out_of_rotation() -> None:
    a, b = decode("a", 4), decode("b", 4)
    a.leak_checked(True)
    led = ledger(a, b)
    rs = [await led.reserve() for _ in range(4)]
    assert {r.instance for r in rs} == {b}
    for r in rs:
        led.release(r)
