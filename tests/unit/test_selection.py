"""One selection (router/engines/selection.py): the order chooser > affinity > policy, the
same for P (the registry) and D (the ledger); and the state whose one writer it relies on."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from router.config import DecodeInstanceConfig, SessionConfig, parse_config
from router.engines.affinity import Affinity, Placement
from router.engines.breaker import Breaker, BreakerState
from router.engines.choice import Chooser
from router.engines.instance import Instance, Role
from router.engines.ledger import SlotLedger
from router.engines.policies import make_policy
from router.engines.selection import Selection, select
from router.errors import Fault
from router.registry import Registry
from tests.fakes.clock import Clock


def _engines(role: Role, n: int, clock: Clock | None = None) -> list[Instance]:
    out = []
    for i in range(n):
        breaker = Breaker(1, 10.0, clock or Clock())
        out.append(Instance(f"http://{role.value}{i}:8000", role, "m", breaker, slots=4))
    return out


def _choosing(target: Instance | None) -> tuple[list[Role], Chooser]:
    asked: list[Role] = []

    def chooser(role: Role, cands: Sequence[Instance]) -> Instance | None:
        asked.append(role)
        return target if target in cands else None

    return asked, chooser


def test_the_chooser_wins_over_affinity_and_policy() -> None:
    ds = _engines(Role.DECODE, 3)
    affinity = Affinity(SessionConfig(), Clock())
    session_pick, _ = affinity.select(Role.DECODE, "s", ds)
    target = next(d for d in ds if d is not session_pick)
    asked, chooser = _choosing(target)
    sel = Selection(session="s", chooser=chooser)
    assert select(Role.DECODE, ds, sel, make_policy("round_robin"), affinity) == (target, None)
    assert asked == [Role.DECODE]


def test_affinity_wins_over_the_policy_when_the_chooser_passes() -> None:
    ds = _engines(Role.DECODE, 3)
    affinity = Affinity(SessionConfig(), Clock())
    first, how = select(
        Role.DECODE,
        ds,
        Selection(session="s", chooser=_choosing(None)[1]),
        make_policy("random"),
        affinity,
    )
    assert how is Placement.PLACED
    # The session sticks whatever the policy would pick (round robin moves every time).
    rr = make_policy("round_robin")
    assert all(
        select(Role.DECODE, ds, Selection(session="s"), rr, affinity) == (first, Placement.HIT)
        for _ in range(5)
    )


def test_without_a_session_the_policy_reads_the_routing_key() -> None:
    ds = _engines(Role.PREFILL, 4)
    policy = make_policy("prefix_hash")
    picks = {select(Role.PREFILL, ds, Selection(routing_key="abc"), policy)[0] for _ in range(5)}
    others = {select(Role.PREFILL, ds, Selection(routing_key=str(k)), policy)[0] for k in range(40)}
    assert len(picks) == 1 and len(others) > 1


def test_avoided_engines_are_passed_over_while_another_is_left() -> None:
    a, b = _engines(Role.DECODE, 2)
    _, chooser = _choosing(a)
    sel = Selection(avoid=frozenset({a}), chooser=chooser)
    assert select(Role.DECODE, [a, b], sel, make_policy("round_robin"))[0] is b
    assert select(Role.DECODE, [a], sel, make_policy("round_robin"))[0] is a  # better than none


def _pd_registry() -> Registry:
    return Registry(
        parse_config(
            {
                "models": [
                    {
                        "name": "m",
                        "mode": "pull",
                        "policy": {"prefill": "round_robin", "decode": "round_robin"},
                        "sessions": {"enabled": True},
                        "prefill": [{"url": f"http://p{i}:1"} for i in range(3)],
                        "decode": [{"url": f"http://d{i}:1", "slots": 4} for i in range(3)],
                    }
                ]
            }
        )
    )


async def test_the_registry_and_the_ledger_follow_the_same_order() -> None:
    reg = _pd_registry()
    pool = reg.get("m")
    assert pool is not None
    for role in (Role.PREFILL, Role.DECODE):
        for d in pool.of_role(role):
            d.healthy = True
    p_target, d_target = pool.prefill[2], pool.decode[2]

    def chooser(role: Role, cands: Sequence[Instance]) -> Instance | None:
        return p_target if role is Role.PREFILL else d_target

    chosen = Selection(session="s", chooser=chooser)
    lease = pool.select_prefill(chosen)
    assert lease is not None and (lease.instance, lease.placement) == (p_target, None)
    held = await pool.ledger.reserve(chosen)
    assert (held.instance, held.placement) == (d_target, None)
    # The chooser passes: both places follow the session, not round robin.
    sticky = Selection(session="t")
    p_first = pool.select_prefill(sticky)
    d_first = await pool.ledger.reserve(sticky)
    assert p_first is not None and d_first.placement is Placement.PLACED
    for _ in range(3):
        again = pool.select_prefill(sticky)
        assert again is not None and (again.instance, again.placement) == (
            p_first.instance,
            Placement.HIT,
        )
        got = await pool.ledger.reserve(sticky)
        assert (got.instance, got.placement) == (d_first.instance, Placement.HIT)
        pool.ledger.release(got)


async def test_a_decode_engine_discovered_is_the_ledgers_without_a_sync_call() -> None:
    reg = Registry(
        parse_config(
            {
                "models": [
                    {
                        "name": "m",
                        "mode": "aggregated",
                        "decode": [{"url": "http://d0:1", "slots": 1}],
                    }
                ]
            }
        )
    )
    pool = reg.get("m")
    assert pool is not None
    pool.decode[0].healthy = True
    held = await pool.ledger.reserve()
    waiter = asyncio.create_task(pool.ledger.reserve(Selection(api_key_name="k")))
    await asyncio.sleep(0)
    assert not waiter.done() and pool.ledger.queue_depth == 1
    wanted = [*pool.config.decode, DecodeInstanceConfig(url="http://d1:1", slots=1)]  # type: ignore[call-arg]
    reg.set_instances("m", [], wanted)
    assert pool.decode is pool.ledger.instances  # one list: the pool reads the ledger's
    assert [d.key for d in pool.decode] == ["http://d0:1", "http://d1:1"]
    pool.decode[1].healthy = True  # the new engine passes its first check: the waiter fits
    got = await asyncio.wait_for(waiter, 1.0)
    assert got.instance is pool.decode[1] and got.api_key_name == "k"
    assert pool.ledger.held("k") == 1
    pool.ledger.release(got)
    pool.ledger.release(held)


def test_registry_listeners_are_a_list_each_with_its_own_unsubscribe() -> None:
    reg = _pd_registry()
    calls: list[str] = []
    stop_a = reg.subscribe(lambda: calls.append("a"))
    reg.subscribe(lambda: calls.append("b"))
    pool = reg.get("m")
    assert pool is not None
    reg.set_instances("m", pool.config.prefill, pool.config.decode)
    assert calls == ["a", "b"]
    stop_a()
    stop_a()  # idempotent
    reg.set_instances("m", pool.config.prefill, pool.config.decode)
    assert calls == ["a", "b", "b"]


async def test_the_half_open_trial_is_taken_where_an_engine_gets_its_request() -> None:
    """The instance alone calls the breaker's ``on_dispatch``: a slot taken (D), a P leg run."""
    clock = Clock()
    (d,) = _engines(Role.DECODE, 1, clock)
    (p,) = _engines(Role.PREFILL, 1, clock)
    for inst in (d, p):
        inst.breaker.record(Fault.ENGINE)
    clock.advance(10.0)
    assert d.breaker.state is BreakerState.HALF_OPEN and d.breaker.allows()
    led = SlotLedger("m", [d], make_policy("round_robin"), 4, 1.0, clock=clock)
    held = await led.reserve()
    assert held.instance is d and not d.breaker.allows()  # the one trial is out
    led.release(held)
    assert p.breaker.allows()
    with p.running_leg():
        assert not p.breaker.allows()


def test_the_leak_watch_has_one_writer_per_verdict() -> None:
    (d,) = _engines(Role.DECODE, 1)
    d.healthy = True
    d.suspect_leak()
    assert d.suspect and not d.degraded and d.in_rotation
    d.leak_checked(True)
    assert d.suspect and d.degraded and not d.in_rotation
    d.leak_checked(False)
    assert not d.suspect and not d.degraded and d.in_rotation
