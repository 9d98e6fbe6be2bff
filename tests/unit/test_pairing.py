"""Pairing by what engines run (router/engines/pairing.py): the rules per mode, and a pool that
takes out of rotation the engines nothing can pair with and picks P by the reserved D."""

from __future__ import annotations

import pytest

from router.config import Mode, parse_config
from router.engines.pairing import EngineFacts, mismatch, release
from router.engines.selection import Selection
from router.errors import NoHealthyEngine
from router.registry import ModelPool, Registry

V32, V33, V34 = "0.32.0", "0.33.0", "0.34.0"


@pytest.mark.parametrize(
    ("version", "expected"),
    [("0.34.0", (0, 34)), ("0.34.1+cu128", (0, 34)), ("0.35.0rc1", (0, 35)), ("dev", None)],
)
def test_release(version: str, expected: tuple[int, int] | None) -> None:
    assert release(version) == expected


@pytest.mark.parametrize(
    ("mode", "p", "d", "refused"),
    [
        # NIXL's hash includes vLLM's version string: releases and patch releases refuse.
        (Mode.PULL, EngineFacts(V33), EngineFacts(V34), True),
        (Mode.PUSH, EngineFacts("0.34.0"), EngineFacts("0.34.1"), True),
        (Mode.PUSH_SEQUENTIAL, EngineFacts(V32), EngineFacts(V33), True),
        (Mode.PULL, EngineFacts(V34, 16), EngineFacts(V34, 64), False),  # pull maps blocks
        (Mode.PUSH, EngineFacts(V33, 16), EngineFacts(V33, 64), False),  # a ratio before 0.34
        (Mode.PUSH, EngineFacts(V34, 16), EngineFacts(V34, 64), True),  # equal from 0.34
        (Mode.PUSH_SEQUENTIAL, EngineFacts(V34, 16), EngineFacts(V34, 64), True),
        (Mode.PUSH, EngineFacts(V34, 64), EngineFacts(V34, 64), False),
        # This project's connector: its own wire, the cache's shape; no vLLM version.
        (Mode.PIPELINED, EngineFacts(V32, 16), EngineFacts(V34, 16), False),
        (Mode.PIPELINED, EngineFacts(V34, 16), EngineFacts(V34, 64), True),
        (Mode.AGGREGATED, EngineFacts(V32, 16), EngineFacts(V34, 64), False),
        # Unknown facts never refuse (the engines' handshakes still guard the pair).
        (Mode.PULL, EngineFacts(None), EngineFacts(V34), False),
        (Mode.PUSH, EngineFacts(V34, None), EngineFacts(V34, 64), False),
        (Mode.PIPELINED, EngineFacts(V34, 16), EngineFacts(V34, None), False),
    ],
)
def test_mismatch(mode: Mode, p: EngineFacts, d: EngineFacts, refused: bool) -> None:
    why = mismatch(mode, p, d)
    assert (why is not None) is refused, why


def test_the_reason_names_both_sides() -> None:
    assert mismatch(Mode.PULL, EngineFacts(V33), EngineFacts(V34)) == (
        "vLLM 0.33.0 on P and 0.34.0 on D: NIXL's handshake refuses engines of different "
        "vLLM versions"
    )
    why = mismatch(Mode.PUSH, EngineFacts(V34, 16), EngineFacts(V34, 64))
    assert why is not None and "block size 16 on P and 64 on D" in why


def _pool(mode: str, n_p: int, n_d: int, pairing: str = "checked") -> ModelPool:
    model = {
        "name": "tiny",
        "mode": mode,
        "pairing": pairing,
        "prefill": [{"url": f"http://p{i}:8000"} for i in range(n_p)],
        "decode": [{"url": f"http://d{i}:8000", "slots": 2} for i in range(n_d)],
    }
    pool = Registry(parse_config({"models": [model]})).get("tiny")
    assert pool is not None
    return pool


def _learn(pool: ModelPool, facts: dict[str, EngineFacts]) -> None:
    """As the health monitor does: each engine's facts, then the pool's check."""
    for inst in (*pool.prefill, *pool.decode):
        f = facts[inst.url.removeprefix("http://").removesuffix(":8000")]
        inst.learn_version(f.version)
        inst.learn_block_size(f.block_size)
        inst.healthy = True
    pool.check_pairs()


def test_a_rolling_upgrade_pairs_each_release_with_its_own() -> None:
    pool = _pool("pull", 2, 2)
    _learn(pool, {"p0": EngineFacts(V33), "p1": EngineFacts(V34),
                  "d0": EngineFacts(V33), "d1": EngineFacts(V34)})  # fmt: skip
    assert all(i.unpaired is None and i.routable for i in (*pool.prefill, *pool.decode))
    d0, d1 = pool.decode
    for _ in range(4):  # whatever the policy would pick
        for d, want in ((d0, "http://p0:8000"), (d1, "http://p1:8000")):
            lease = pool.select_prefill(Selection(), decode=d)
            assert lease is not None and lease.instance.url == want
    assert pool.has_healthy_pair()


def test_an_engine_nothing_pairs_with_leaves_rotation_and_comes_back() -> None:
    pool = _pool("push", 1, 2)
    _learn(pool, {"p0": EngineFacts(V34, 64), "d0": EngineFacts(V34, 64),
                  "d1": EngineFacts(V34, 16)})  # fmt: skip
    d0, d1 = pool.decode
    assert d0.unpaired is None and d0.routable
    assert d1.unpaired is not None and "block size 64 on P and 16 on D" in d1.unpaired
    assert not d1.routable and not d1.in_rotation
    assert d1.why_out().startswith("no engine to pair with: ")
    d1.learn_block_size(64)  # restarted with --block-size 64
    pool.check_pairs()
    assert d1.unpaired is None and d1.routable


async def test_no_compatible_pair_is_refused_with_the_reason() -> None:
    pool = _pool("pull", 1, 1)
    _learn(pool, {"p0": EngineFacts(V33), "d0": EngineFacts(V34)})
    assert not pool.has_healthy_pair()
    with pytest.raises(NoHealthyEngine) as refused:
        await pool.ledger.reserve()
    err = refused.value
    assert err.code == "no_compatible_pair"
    assert str(err) == (
        "no decode engine for model 'tiny' can pair with an engine of the other role: "
        "vLLM 0.33.0 on P and 0.34.0 on D: NIXL's handshake refuses engines of different "
        "vLLM versions"
    )
    assert pool.select_prefill(Selection()) is None  # P is out the same way


def test_pairing_any_trusts_the_operator() -> None:
    pool = _pool("pull", 1, 1, pairing="any")
    _learn(pool, {"p0": EngineFacts(V33), "d0": EngineFacts(V34)})
    assert pool.has_healthy_pair()
    assert all(i.unpaired is None for i in (*pool.prefill, *pool.decode))


def test_aggregated_pairs_nothing() -> None:
    pool = _pool("aggregated", 1, 1)
    _learn(pool, {"p0": EngineFacts(V33), "d0": EngineFacts(V34, 64)})
    assert pool.decode[0].unpaired is None and pool.has_healthy_pair()
