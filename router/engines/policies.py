"""Load-balancing policies: choose one instance among eligible candidates.

Each policy is a small class with a ``name`` (its config and metrics label) and
``select(candidates, routing_key)``; ``routing_key`` is a request's stable start (a
prompt prefix, router/pd/routing.py) used only by ``prefix_hash``. Candidates are never empty.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from typing import ClassVar, Protocol

from router.engines.instance import Instance

__all__ = ["Policy", "make_policy"]


class Policy(Protocol):
    name: ClassVar[str]
    needs_routing_key: ClassVar[bool]

    def select(self, candidates: Sequence[Instance], routing_key: str | None) -> Instance: ...


def _load(inst: Instance) -> float:
    # Decode load is relative to its slot count (every worker's, with --workers);
    # prefill load is its running legs.
    return inst.in_use / inst.slots if inst.slots else float(inst.legs_running)


class RoundRobin:
    name: ClassVar[str] = "round_robin"
    needs_routing_key: ClassVar[bool] = False

    def __init__(self) -> None:
        self._next = 0

    def select(self, candidates: Sequence[Instance], routing_key: str | None) -> Instance:
        inst = candidates[self._next % len(candidates)]
        self._next += 1
        return inst


class LeastLoaded:
    name: ClassVar[str] = "least_loaded"
    needs_routing_key: ClassVar[bool] = False

    def __init__(self) -> None:
        self._tiebreak = 0

    def select(self, candidates: Sequence[Instance], routing_key: str | None) -> Instance:
        # Rotate the starting point so equal loads spread instead of piling on the first.
        self._tiebreak += 1
        n = len(candidates)
        rotated = [candidates[(i + self._tiebreak) % n] for i in range(n)]
        return min(rotated, key=_load)


class PowerOfTwo:
    name: ClassVar[str] = "power_of_two"
    needs_routing_key: ClassVar[bool] = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Instance], routing_key: str | None) -> Instance:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return a if _load(a) <= _load(b) else b


class Random:
    name: ClassVar[str] = "random"
    needs_routing_key: ClassVar[bool] = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Instance], routing_key: str | None) -> Instance:
        return self._rng.choice(list(candidates))


class PrefixHash:
    """Rendezvous hashing on a prompt prefix: the same prefix goes to the same
    engine (its prefix cache), and only 1/N of keys move when an engine leaves."""

    name: ClassVar[str] = "prefix_hash"
    needs_routing_key: ClassVar[bool] = True

    def select(self, candidates: Sequence[Instance], routing_key: str | None) -> Instance:
        if routing_key is None:
            return min(candidates, key=_load)
        data = routing_key.encode("utf-8", "replace")
        return max(candidates, key=lambda c: zlib.crc32(c.key.encode() + data))


_POLICIES: dict[str, type[RoundRobin | LeastLoaded | PowerOfTwo | Random | PrefixHash]] = {
    p.name: p for p in (RoundRobin, LeastLoaded, PowerOfTwo, Random, PrefixHash)
}


def make_policy(name: str) -> Policy:
    return _POLICIES[name]()
