"""Per-key limits, the fair admission queue and key checks, with a fake clock and no
sockets (tests/integration/test_limits.py has them over real sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import Callable

import pytest

from router.auth import ANONYMOUS, Authenticator
from router.config import AuthConfig, ConfigError, KeyLimits, parse_config
from router.engines.breaker import Breaker
from router.engines.fair_queue import FairQueue
from router.engines.instance import Instance, Role
from router.engines.ledger import SlotLedger
from router.engines.policies import make_policy
from router.engines.selection import Selection
from router.errors import FairShareExceeded, QueueFull, RateLimited, Unauthorized
from router.limits import Limiter, TokenBucket
from tests.fakes.clock import Clock

# -- token bucket and limiter ------------------------------------------------------------


def test_token_bucket_refills_at_its_rate_up_to_its_size() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=2.0, size=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.5)  # one token every 0.5 s
    clock.now = 0.25
    assert bucket.take() == pytest.approx(0.25)
    clock.now = 0.5
    assert bucket.take() == 0.0
    clock.now = 100.0  # a long pause refills the bucket to its size, not beyond
    assert [bucket.take() for _ in range(4)][-1] == pytest.approx(0.5)


def test_rate_limit_per_key_with_retry_after() -> None:
    clock = Clock()
    own = {"slow": KeyLimits(requests_per_second=0.1, burst=1), "free": None}
    limiter = Limiter(KeyLimits(), own, clock)
    limiter.charge("slow")
    with pytest.raises(RateLimited) as info:
        limiter.charge("slow")
    assert (info.value.status, info.value.code) == (429, "rate_limit_exceeded")
    assert info.value.headers() == {"retry-after": "10"}
    assert "'slow'" in info.value.message
    for _ in range(100):
        limiter.charge("free")  # no rate of its own, none by default
    clock.now = 10.0
    limiter.charge("slow")


def test_concurrency_limit_and_leases() -> None:
    limiter = Limiter(KeyLimits(max_concurrent=2), {}, Clock())
    a, b = limiter.acquire("k"), limiter.acquire("k")
    with pytest.raises(RateLimited) as info:
        limiter.acquire("k")
    assert info.value.code == "concurrency_limit_exceeded"
    assert info.value.headers() == {"retry-after": "1"}
    limiter.acquire("other").release()  # the default applies to each key on its own
    a.release()
    a.release()  # idempotent: gives back one, once
    assert limiter.in_flight("k") == 1
    limiter.acquire("k")
    b.release()
    assert limiter.in_flight("k") == 1


# -- the fair queue ---------------------------------------------------------------------


def test_fair_queue_serves_the_key_holding_fewest_slots_first() -> None:
    held = {"flood": 4, "quiet": 0}
    q: FairQueue[str] = FairQueue(lambda k: (held.get(k, 0), 0))
    for i in range(5):
        q.push("flood", f"f{i}")
    q.push("quiet", "q0")
    q.push("quiet", "q1")
    assert q.pop() == "q0"  # arrived last, holds nothing: first
    held["quiet"] = 4  # now holds as many: the longest waiting go first
    assert [q.pop(), q.pop()] == ["f0", "f1"]
    held["flood"] = 6  # holds more: quiet's turn
    assert [q.pop() for _ in range(4)] == ["q1", "f2", "f3", "f4"]
    assert len(q) == 0 and q.peek() is None


def test_fair_queue_remove_and_longest_queue_drop() -> None:
    q: FairQueue[str] = FairQueue(lambda k: (0, 0))
    for i in range(3):
        q.push("flood", f"f{i}")
    q.push("quiet", "q0")
    assert q.remove("flood", "f1") and not q.remove("flood", "f1")
    assert q.overflow("quiet") is None  # flood 2, quiet would have 2: none over its share
    q.push("flood", "f3")
    q.push("flood", "f4")
    assert q.overflow("flood") is None  # the longest queue itself is refused
    assert q.overflow("quiet") == "f4"  # its newest waiter makes room
    assert list(q) == ["f0", "f2", "f3", "q0"] and len(q) == 4


def _decode(slots: int) -> Instance:
    return Instance("d", Role.DECODE, "m", Breaker(3, 10.0, Clock()), slots=slots)


async def _queued(led: SlotLedger, depth: int) -> None:
    """Until ``depth`` requests wait in ``led``'s queue."""
    await asyncio.wait_for(_poll(lambda: led.queue_depth == depth), 10.0)


async def _poll(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.001)


async def test_ledger_gives_a_freed_slot_to_the_key_holding_fewest() -> None:
    d = _decode(2)
    led = SlotLedger("m", [d], make_policy("least_loaded"), 10, 5.0, clock=Clock())
    flood = [await led.reserve(Selection(api_key_name="flood")) for _ in range(2)]
    waiting = [asyncio.create_task(led.reserve(Selection(api_key_name="flood"))) for _ in range(3)]
    await _queued(led, 3)
    quiet = asyncio.create_task(led.reserve(Selection(api_key_name="quiet")))
    await _queued(led, 4)
    assert led.held("flood") == 2
    # A release hands the slot over at once: to quiet, the key holding none.
    led.release(flood[0])
    assert led.held("quiet") == 1 and led.held("flood") == 1 and led.queue_depth == 3
    quiet_slot = await asyncio.wait_for(quiet, 10.0)
    assert not any(t.done() for t in waiting)  # still queued: three waiters, no free slot
    led.release(flood[1])  # flood holds none now: its oldest waiter is next
    assert led.held("flood") == 1 and led.queue_depth == 2
    first = await asyncio.wait_for(waiting[0], 10.0)
    assert not waiting[1].done() and not waiting[2].done()
    led.release(quiet_slot)
    for task in waiting[1:]:
        task.cancel()
    await asyncio.gather(*waiting[1:], return_exceptions=True)
    led.release(first)
    assert led.slots_in_use == 0 and led.held("flood") == led.held("quiet") == 0


async def test_a_full_queue_refuses_the_key_holding_most_of_it() -> None:
    d = _decode(1)
    led = SlotLedger("m", [d], make_policy("least_loaded"), 2, 5.0, clock=Clock())
    held = await led.reserve(Selection(api_key_name="flood"))
    waiting = [asyncio.create_task(led.reserve(Selection(api_key_name="flood"))) for _ in range(2)]
    await _queued(led, 2)
    with pytest.raises(QueueFull) as alone:  # its own queue is full: not a share issue
        await led.reserve(Selection(api_key_name="flood"))
    assert type(alone.value) is QueueFull
    quiet = asyncio.create_task(led.reserve(Selection(api_key_name="quiet")))
    with pytest.raises(FairShareExceeded) as evicted:
        await asyncio.wait_for(waiting[1], 10.0)  # flood's newest waiter made room for quiet
    assert evicted.value.code == "queue_share_exceeded" and evicted.value.status == 429
    await _queued(led, 2)  # flood's oldest and quiet
    with pytest.raises(FairShareExceeded):  # and now flood is over its share
        await led.reserve(Selection(api_key_name="flood"))
    led.release(held)  # both hold no slot now: the one served least recently goes first
    assert led.held("quiet") == 1 and led.queue_depth == 1
    quiet_slot = await asyncio.wait_for(quiet, 10.0)
    assert not waiting[0].done()
    led.release(quiet_slot)
    led.release(await asyncio.wait_for(waiting[0], 10.0))
    assert led.slots_in_use == 0 and led.queue_depth == 0


# -- keys --------------------------------------------------------------------------------


def _auth(**kw: object) -> Authenticator:
    return Authenticator(AuthConfig.model_validate(kw))


def test_keys_are_known_by_name() -> None:
    auth = _auth(keys=[{"name": "team-a", "key": "ka"}], api_keys=["kb", "kc"])
    assert auth.names == ["team-a", "api_keys.0", "api_keys.1"]
    assert auth.identify([(b"authorization", b"Bearer ka")]) == "team-a"
    assert auth.identify([(b"authorization", b"bearer kc")]) == "api_keys.1"
    assert _auth().identify([]) == ANONYMOUS and not _auth().enabled


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (None, "missing"),
        (b"Basic ka", "scheme"),
        (b"Token ka", "scheme"),
        (b"ka", "scheme"),
        (b"Bearer kz", "invalid"),
        (b"Bearer ", "invalid"),
    ],
)
def test_anything_but_a_bearer_key_is_refused(header: bytes | None, reason: str) -> None:
    auth = _auth(keys=[{"name": "team-a", "key": "ka"}])
    headers = [] if header is None else [(b"authorization", header)]
    with pytest.raises(Unauthorized) as info:
        auth.identify(headers)
    assert info.value.reason == reason and info.value.status == 401


def test_every_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """One ``hmac.compare_digest`` per key, of equal-length digests, whichever matches."""
    calls: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    keys = [{"name": f"k{i}", "key": "x" * (i + 1)} for i in range(4)]
    auth = _auth(keys=keys)
    for given in (b"Bearer x", b"Bearer xxxx", b"Bearer nope-a-longer-one"):
        calls.clear()
        with contextlib.suppress(Unauthorized):
            auth.identify([(b"authorization", given)])
        assert calls == [(32, 32)] * 4


# -- configuration --------------------------------------------------------------------------


MODEL = {"name": "m", "mode": "aggregated", "decode": [{"url": "http://h:1"}]}


def _problems(data: dict[str, object]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config({"models": [MODEL], **data})
    return [p.strip() for p in info.value.problems]


def test_closed_and_bounded_by_default() -> None:
    cfg = parse_config({"models": [MODEL]})
    assert cfg.cors.allowed_origins == []  # as vllm serve 0.32
    assert cfg.limits.max_n == 128 and cfg.limits.per_key == KeyLimits()
    assert cfg.connections.max_headers == 100 and cfg.connections.header_timeout == 10


@pytest.mark.parametrize(
    ("auth", "problem"),
    [
        ({"keys": [{"name": "a b", "key": "k"}]}, "auth.keys.0.name: String should match"),
        ({"keys": [{"name": "a", "key": " "}]}, "auth.keys.0.key: must not be empty"),
        ({"api_keys": [""]}, "auth.api_keys: a key must not be empty"),
        (
            {"keys": [{"name": "a", "key": "k"}, {"name": "a", "key": "j"}]},
            "auth.keys: key name listed twice: ['a']",
        ),
        ({"keys": [{"name": "a", "key": "k"}], "api_keys": ["k"]}, "the same key is given twice"),
        ({"keys": [{"name": "anonymous", "key": "k"}]}, "are the router's own"),
        (
            {"keys": [{"name": "a", "key": "k", "limits": {"requests_per_second": 0}}]},
            "auth.keys.0.limits.requests_per_second: Input should be greater than 0",
        ),
    ],
)
def test_key_mistakes_are_reported_with_their_path(auth: dict[str, object], problem: str) -> None:
    found = _problems({"auth": auth})
    assert any(problem in p for p in found), found
