"""Priority classes: the queue's order between classes (aging on a hand-moved clock),
a request's class from its header, body or the default, and the config's checks."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from router.client_request import ClientRequest, Endpoint, parse_client_request
from router.config import AdmissionConfig, ConfigError, parse_config
from router.engines.breaker import Breaker
from router.engines.fair_queue import FairQueue
from router.engines.instance import Instance, Role
from router.engines.ledger import Deadline, SlotLedger
from router.engines.policies import make_policy
from router.errors import DeadlineExceeded, DeadlineUnattainable, InvalidRequest
from router.priority import Priority, deadline_ms, resolve, with_priority
from tests.fakes.clock import Clock

CLASSES = AdmissionConfig.model_validate(
    {
        "priority_classes": {"interactive": {"priority": -10}, "batch": {"priority": 10}},
        "default_priority_class": "batch",
    }
)


# -- the queue ----------------------------------------------------------------------------


def test_a_more_urgent_class_goes_first_and_keys_share_within_a_class() -> None:
    held = {"a": 3, "b": 0}
    q: FairQueue[str] = FairQueue(lambda k: (held.get(k, 0), 0), Clock())
    q.push("b", "b-low", level=2)
    q.push("a", "a-high-0", level=0)
    q.push("b", "b-high-0", level=0)
    q.push("a", "a-high-1", level=0)
    # Within level 0 the key holding fewer slots first; level 2 only when 0 is empty.
    assert q.pop() == "b-high-0"
    held["b"] = 3
    assert [q.pop(), q.pop(), q.pop()] == ["a-high-0", "a-high-1", "b-low"]


def test_aging_raises_a_waiting_class_one_level_per_period() -> None:
    clock = Clock()
    q: FairQueue[str] = FairQueue(lambda k: (0, 0), clock, aging=10.0)
    q.push("k", "low", level=2)
    clock.advance(10.0)  # low is now level 1
    q.push("k", "mid", level=1)
    q.push("k", "high", level=0)
    assert q.peek() == "high"
    clock.advance(9.9)  # low waited 19.9 s: still level 1, arrived before mid
    assert q.remove("k", "high", level=0)
    assert q.peek() == "low"
    q.push("k", "high2", level=0)
    assert q.peek() == "high2"
    clock.advance(0.1)  # low waited 20 s and mid 10 s: both level 0, before high2
    assert [q.pop(), q.pop(), q.pop()] == ["low", "mid", "high2"]


def test_within_a_class_the_earliest_deadline_goes_first() -> None:
    """EDF within a key's lane and between keys ranked alike; a waiter without a deadline
    after every one with, then by arrival; a more urgent class still goes first."""
    q: FairQueue[str] = FairQueue(lambda k: (0, 0), Clock())
    q.push("a", "a-none", level=1)
    q.push("a", "a-late", level=1, deadline=9.0)
    q.push("b", "b-early", level=1, deadline=3.0)
    q.push("a", "a-early", level=1, deadline=5.0)
    q.push("b", "b-none", level=1)
    q.push("c", "c-urgent-none", level=0)
    popped = [q.pop() for _ in range(6)]
    assert popped == ["c-urgent-none", "b-early", "a-early", "a-late", "a-none", "b-none"]


def test_overflow_drops_the_longest_keys_least_urgent_newest() -> None:
    q: FairQueue[str] = FairQueue(lambda k: (0, 0), Clock())
    q.push("flood", "f-low-0", level=1)
    q.push("flood", "f-high", level=0)
    q.push("flood", "f-low-1", level=1)
    assert q.overflow("quiet") == "f-low-1"
    assert q.waiting("flood") == 2 and len(q) == 2


# -- a request's class --------------------------------------------------------------------


def _headers(value: str | None) -> list[tuple[bytes, bytes]]:
    return [] if value is None else [(b"x-priority", value.encode())]


@pytest.mark.parametrize(
    ("header", "body", "expected"),
    [
        ("interactive", {}, Priority("interactive", -10, 0)),
        (None, {"priority": -10}, Priority("interactive", -10, 0)),
        (None, {}, Priority("batch", 10, 2)),  # the default class
        ("batch", {"priority": -10}, Priority("batch", 10, 2)),  # the header wins
    ],
)
def test_the_class_from_header_body_or_default(
    header: str | None, body: dict[str, Any], expected: Priority
) -> None:
    assert resolve(CLASSES, _headers(header), body) == expected


@pytest.mark.parametrize(
    ("header", "body", "param"),
    [("urgent", {}, "x-priority"), (None, {"priority": 3}, "priority")],
)
def test_an_unknown_class_is_a_400_naming_it(
    header: str | None, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        resolve(CLASSES, _headers(header), body)
    assert info.value.status == 400 and info.value.param == param


def test_a_non_integer_priority_is_a_400() -> None:
    with pytest.raises(InvalidRequest, match="integer"):
        resolve(CLASSES, [], {"priority": True})


def test_without_classes_every_request_is_one_class() -> None:
    assert resolve(AdmissionConfig(), _headers("anything"), {"priority": 5}) == Priority("", 0, 0)


def _creq(body: dict[str, Any]) -> ClientRequest:
    return parse_client_request(
        orjson.dumps({"model": "m", "prompt": "x", **body}), Endpoint.COMPLETIONS, "k"
    )


def test_the_legs_carry_priority_only_to_engines_that_schedule_by_it() -> None:
    creq = _creq({"priority": -10})
    on = with_priority(creq, [], CLASSES, engine_priority=True)
    assert on.body["priority"] == -10 and on.priority_class == "interactive"
    default = with_priority(_creq({}), [], CLASSES, engine_priority=True)
    assert default.body["priority"] == 10
    off = with_priority(creq, [], CLASSES, engine_priority=False)
    assert "priority" not in off.body and off.priority_level == 0
    bare = with_priority(_creq({"priority": 7}), [], AdmissionConfig(), engine_priority=False)
    assert "priority" not in bare.body
    assert creq.body["priority"] == -10  # the client's body is never mutated


def test_a_request_without_class_or_deadline_is_not_copied() -> None:
    """The path of every request of a router without classes: nothing to change, no copy;
    a deadline, or a body to change, makes a new request and leaves the client's alone."""
    plain = _creq({})
    assert with_priority(plain, [], AdmissionConfig(), engine_priority=False) is plain
    timed = with_priority(plain, [(b"x-slo-ttft-ms", b"500")], AdmissionConfig(), False, 2.0)
    assert timed is not plain and timed.deadline_at == 2.5 and plain.deadline_at is None
    kept = _creq({"priority": 10})
    same = with_priority(kept, [], CLASSES, engine_priority=True)
    assert same.body is kept.body and same.priority_class == "batch"


# -- the config ---------------------------------------------------------------------------


def _config(admission: dict[str, Any]) -> Any:
    model = {"name": "m", "mode": "aggregated", "decode": [{"url": "http://d"}]}
    return parse_config({"models": [model], "admission": admission})


def test_the_config_refuses_an_unknown_default_and_duplicate_values() -> None:
    with pytest.raises(ConfigError, match="not a priority class"):
        _config({"priority_classes": {"a": {"priority": 1}}, "default_priority_class": "b"})
    with pytest.raises(ConfigError, match="same priority value"):
        _config({"priority_classes": {"a": {"priority": 1}, "b": {"priority": 1}}})
    with pytest.raises(ConfigError):
        _config({"priority_aging": 0})


# -- deadlines ----------------------------------------------------------------------------


def test_the_deadline_from_the_header_else_the_class() -> None:
    config = AdmissionConfig.model_validate(
        {"priority_classes": {"chat": {"priority": 0, "ttft_deadline_ms": 800}}}
    )
    chat = resolve(config, _headers("chat"), {})
    assert deadline_ms(config, _headers("chat"), chat) == 800
    given = [(b"x-priority", b"chat"), (b"x-slo-ttft-ms", b"250.5")]
    assert deadline_ms(config, given, chat) == 250.5
    assert deadline_ms(config, [], Priority("", 0, 0)) is None
    creq = with_priority(_creq({}), given, config, engine_priority=False, now=100.0)
    assert creq.deadline_at == pytest.approx(100.2505) and creq.ttft_deadline_ms == 250.5


@pytest.mark.parametrize("value", ["0", "-3", "soon", "nan", "inf"])
def test_a_malformed_deadline_is_refused(value: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        deadline_ms(AdmissionConfig(), [(b"x-slo-ttft-ms", value.encode())], Priority("", 0, 0))
    assert info.value.param == "x-slo-ttft-ms"


async def test_a_deadline_already_passed_is_refused_without_queueing_or_a_slot() -> None:
    clock = Clock()
    d = Instance("d", Role.DECODE, "m", Breaker(3, 10.0, clock), slots=1)
    led = SlotLedger("m", [d], make_policy("least_loaded"), 8, 30.0, clock=clock)
    clock.advance(5.0)
    with pytest.raises(DeadlineExceeded) as info:
        await led.reserve(deadline=Deadline(at=4.0, ms=200))
    assert info.value.status == 503 and "200 ms" in info.value.message
    assert d.slots_held == 0 and led.queue_depth == 0


async def _hold_learned(clock: Clock, slots: int, hold: float) -> tuple[Instance, SlotLedger]:
    """A ledger over one D of ``slots`` slots that has seen streams hold a slot ``hold``
    seconds, every slot held again (by requests without a deadline)."""
    d = Instance("d", Role.DECODE, "m", Breaker(3, 10.0, clock), slots=slots)
    led = SlotLedger("m", [d], make_policy("least_loaded"), 64, 300.0, clock=clock)
    first = [await led.reserve() for _ in range(slots)]
    clock.advance(hold)
    for r in first:
        led.release(r)
    for _ in range(slots):
        await led.reserve()
    assert led.hold_s == pytest.approx(hold)
    return d, led


async def test_a_request_predicted_to_miss_its_deadline_is_refused_at_once() -> None:
    """2 slots, both taken just now, streams known to hold a slot 4 s: both expected back
    in 4 s. With 3 more urgent requests waiting, the fourth in line gets the second slot's
    second turn: 4 + 4 = 8 s. A 2 s deadline is refused at once (429 naming it, nothing
    queued or taken); a 30 s one queues. A request of the waiters' class with a deadline
    goes before them (EDF: they have none), so it waits for the first slot back: 4 s,
    within a 5 s deadline, but not a 3 s one.
    """
    clock = Clock()
    d, led = await _hold_learned(clock, 2, 4.0)
    waiters = [asyncio.create_task(led.reserve(level=0)) for _ in range(3)]
    await asyncio.sleep(0)
    assert led.queue_depth == 3
    assert led.predicted_wait(1, clock() + 2.0) == (pytest.approx(8.0), 3)
    with pytest.raises(DeadlineUnattainable) as info:
        await led.reserve(level=1, deadline=Deadline(at=clock() + 2.0, ms=2000))
    assert info.value.status == 429 and info.value.code == "deadline_unattainable"
    assert "2000 ms" in info.value.message and "8000 ms" in info.value.message
    assert info.value.retry_after == pytest.approx(8.0)
    assert led.queue_depth == 3 and d.slots_held == 2
    with pytest.raises(DeadlineUnattainable):
        await led.reserve(level=0, deadline=Deadline(clock() + 3.0, 3000))
    urgent = asyncio.create_task(led.reserve(level=0, deadline=Deadline(clock() + 5.0, 5000)))
    patient = asyncio.create_task(led.reserve(level=1, deadline=Deadline(clock() + 30, 3e4)))
    await asyncio.sleep(0)
    assert led.queue_depth == 5 and not urgent.done() and not patient.done()
    for t in (*waiters, urgent, patient):
        t.cancel()
    await asyncio.gather(*waiters, urgent, patient, return_exceptions=True)


async def test_the_predicted_wait_follows_when_each_held_slot_is_expected_back() -> None:
    """A stream held a slot 4 s; then one slot is taken at 4 s, the other at 7 s: at 7 s
    they are expected back in 1 s and 4 s. The 1st in line waits 1 s, the 2nd 4 s, the
    3rd 1 + 4 s (the first slot's second turn)."""
    clock = Clock()
    d = Instance("d", Role.DECODE, "m", Breaker(3, 10.0, clock), slots=2)
    led = SlotLedger("m", [d], make_policy("least_loaded"), 64, 300.0, clock=clock)
    learned = await led.reserve()
    clock.advance(4.0)
    led.release(learned)
    assert led.hold_s == 4.0
    await led.reserve()
    clock.advance(3.0)
    await led.reserve()
    waits = [led.predicted_wait(0)[0]]
    waiters = []
    for _ in range(2):
        waiters.append(asyncio.create_task(led.reserve()))
        await asyncio.sleep(0)
        waits.append(led.predicted_wait(0)[0])
    assert waits == [pytest.approx(1.0), pytest.approx(4.0), pytest.approx(5.0)]
    for t in waiters:
        t.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


async def test_the_prompts_learned_compute_time_counts_even_with_a_slot_free() -> None:
    clock = Clock()
    d = Instance("d", Role.DECODE, "m", Breaker(3, 10.0, clock), slots=1)
    led = SlotLedger("m", [d], make_policy("least_loaded"), 8, 30.0, clock=clock)
    with pytest.raises(DeadlineUnattainable):
        await led.reserve(deadline=Deadline(at=0.1, ms=100, service_s=0.5))
    assert d.slots_held == 0
    got = await led.reserve(deadline=Deadline(at=1.0, ms=1000, service_s=0.5))
    assert got.instance is d


# -- the API key's class ------------------------------------------------------------------


def test_the_keys_class_comes_after_header_and_body_before_the_default() -> None:
    assert resolve(CLASSES, [], {}, key_class="interactive").name == "interactive"
    assert resolve(CLASSES, [], {"priority": 10}, key_class="interactive").name == "batch"
    assert resolve(CLASSES, _headers("batch"), {}, key_class="interactive").name == "batch"


def test_the_config_refuses_a_key_naming_an_unknown_class() -> None:
    model = {"name": "m", "mode": "aggregated", "decode": [{"url": "http://d"}]}
    auth = {"keys": [{"name": "a", "key": "secret-a", "priority_class": "gold"}]}
    with pytest.raises(ConfigError, match=r"keys\.0\.priority_class 'gold'"):
        parse_config({"models": [model], "auth": auth})
    admission = {"priority_classes": {"gold": {"priority": -1}}}
    parse_config({"models": [model], "auth": auth, "admission": admission})
